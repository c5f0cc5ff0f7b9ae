"""The package layout, which pyproject.toml alone cannot say: the repository keeps the Hydra config
tree at the top (`conf/`), the wheel carries it inside the package (`pipeline/conf/`), where
`lowbit` finds it after `pip install .` without LOWBIT_CONF."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["pipeline", "pipeline.*"]), "pipeline.conf"],
    package_dir={"pipeline.conf": "conf"},
    # the CPU kernels' sources, compiled at first use (pipeline/cpu_ext.py)
    package_data={
        "pipeline.conf": ["*.yaml", "*/*.yaml", "*/*.json"],
        "pipeline": ["csrc/*.cpp", "csrc/*.h"],
    },
)
