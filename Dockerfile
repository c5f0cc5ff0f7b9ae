# lowbit image. The base image brings Python, torch and the accelerator runtime, so one file
# serves GPU and Ascend nodes; pip keeps the base's torch (the project asks for torch>=2.4 only).
#   GPU (default):  docker build -t lowbit:0.1.0-cuda .
#   Ascend (CANN):  docker build --build-arg BASE_IMAGE=<CANN image with torch + torch_npu> \
#                       -t lowbit:0.1.0-cann .
#   run:            docker run --rm -v /data:/data lowbit:0.1.0-cuda experiment=smoke run_dir=/runs/smoke
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

FROM ${BASE_IMAGE}

# 1001: CANN images already use 1000 for HwHiAiUser, the owner of the NPU driver files.
ARG LOWBIT_UID=1001
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LOWBIT_CONF=/opt/lowbit/conf \
    HF_HUB_OFFLINE=1

# Non-editable install from a throw-away copy of the sources: the image holds only the
# installed package, its config tree and the job files.
COPY pyproject.toml README.md /tmp/lowbit-src/
COPY pipeline /tmp/lowbit-src/pipeline
RUN python -m pip install --no-cache-dir /tmp/lowbit-src \
    && rm -rf /tmp/lowbit-src \
    && python -c "import torch, pipeline; print('torch', torch.__version__)"

COPY conf /opt/lowbit/conf
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
