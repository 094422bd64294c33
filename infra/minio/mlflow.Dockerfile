# MLflow tracking server with boto3, which the official image lacks and which the
# server needs to proxy artifacts to MinIO (--artifacts-destination s3://...).
ARG MLFLOW_VERSION=3.17.2
FROM ghcr.io/mlflow/mlflow:v${MLFLOW_VERSION}
RUN pip install --no-cache-dir "boto3==1.43.117"
