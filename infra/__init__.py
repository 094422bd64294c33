"""Infrastructure tooling: bucket administration (`python -m infra.bucket`), the local
stack (minio/) and the Prefect deployments (prefect.yaml). Never imported by the product."""
