# lowbit image. The base image brings Python, torch and the accelerator runtime, so one file
# serves GPU and Ascend nodes; pip keeps the base's torch (the project asks for torch>=2.6 only,
# and constraints.txt leaves torch out).
#   GPU (default):  docker build -t lowbit:0.1.0-cuda .
#   Ascend (CANN):  docker build --build-arg BASE_IMAGE=<CANN image with torch + torch_npu> \
#                       -t lowbit:0.1.0-cann .
#   run:            docker run --rm -v /data:/data lowbit:0.1.0-cuda experiment=smoke \
#                       run_dir=/data/runs/smoke tracking.uri=sqlite:////data/runs/mlflow.db \
#                       tracking.artifact_location=/data/runs/mlartifacts
# The run directory and the MLflow store go in the mounted volume (the container's own files are
# gone when it exits), which the image's user (LOWBIT_UID) must be able to write.
# The base is the torch release CI tests (.ci/setup; tests/test_packaging.py checks the two agree),
# named as pytorch's images are: <torch>-cuda<X.Y>-cudnn<N>-runtime.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE}

# 1001: CANN images already use 1000 for HwHiAiUser, the owner of the NPU driver files.
ARG LOWBIT_UID=1001
# Every engine CI tests: DeepSpeed ZeRO trainers, the Slurm (submitit) launcher, the
# compressed-tensors export and lm-eval tasks.
ARG LOWBIT_EXTRAS=deepspeed,slurm,compressed-tensors,eval,gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Dependencies first, in their own layer: it is rebuilt only when pyproject.toml, setup.py or
# constraints.txt change, not on every code change. They are installed through a stub of the
# package (an empty `pipeline`), so pip reads the dependency list from pyproject.toml itself.
# constraints.txt (the versions CI tested) applies where the base has the Python it was frozen with.
WORKDIR /tmp/lowbit-src
COPY pyproject.toml setup.py README.md LICENSE constraints.txt ./
# DL3013: the versions are pinned, by constraints.txt, which hadolint cannot see.
# hadolint ignore=DL3013
RUN mkdir -p pipeline conf \
    && touch pipeline/__init__.py \
    && py=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    && pins=() \
    && if grep -qx "# python ${py}" constraints.txt; then pins=(-c constraints.txt); fi \
    && python -m pip install --no-cache-dir "${pins[@]}" ".[${LOWBIT_EXTRAS}]" \
    && python -m pip uninstall --yes lowbit

# The code: a non-editable install without dependencies (they are above). The config tree ships
# inside the package (pipeline/conf); the image keeps only the installed package and the job files.
COPY pipeline pipeline
COPY conf conf
RUN python -m pip install --no-cache-dir --no-deps . \
    && python -c "import torch, pipeline; print('torch', torch.__version__)" \
    && rm -rf /tmp/lowbit-src

COPY jobs /opt/lowbit/jobs

# Runs, caches (torch extensions for DeepSpeed, HF) and outputs belong to an unprivileged user;
# on CANN images it joins HwHiAiUser's group, which may open the NPU devices.
RUN useradd --create-home --user-group --uid "${LOWBIT_UID}" --shell /bin/bash lowbit \
    && if getent group HwHiAiUser >/dev/null; then usermod -aG HwHiAiUser lowbit; fi \
    && mkdir -p /runs \
    && chown lowbit:lowbit /runs
USER ${LOWBIT_UID}
WORKDIR /runs

ENTRYPOINT ["lowbit"]
CMD ["--help"]
