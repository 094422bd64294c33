# Prefect server. Prefect 3.8 breaks with FastAPI 0.155+ (docs/design.md),
# so the FastAPI in the image is pinned below 0.151 whatever the image shipped with.
ARG PREFECT_VERSION=3.8.8
FROM prefecthq/prefect:${PREFECT_VERSION}-python3.11
RUN pip install --no-cache-dir "fastapi<0.151"
