# The two commands of the README. Each sets everything up first (scripts/setup is a
# no-op when .venv is current).
.PHONY: setup run test containers lint bench check-image local-s3 rehearse

# Let Python keep its bytecode cache (__pycache__, ignored by git and the image): a
# shell that sets PYTHONDONTWRITEBYTECODE (some sandboxes and CI images do) makes every
# process the suite starts compile the project's modules again, about 0.4 s of CPU
# each (python -c "import flows.worker, flows.aggregator, cli": 3.8 s, cached 3.3 s).
unexport PYTHONDONTWRITEBYTECODE

setup:
	scripts/setup

run: setup
	.venv/bin/diloco run

# The same run on S3: SeaweedFS serves runs/.seaweedfs while it runs (docs/local-s3.md).
local-s3: setup
	.venv/bin/diloco run --store local-s3

# Two pytest workers, each taking whole test files (a file's servers start once): the
# suite is CPU-bound, so more workers than cores only slows every test down. Files go
# out slowest first (tests/conftest.py SLOWEST_FILES), not by their number of tests.
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The tests that build the image and run it in a Docker engine of their own (as root;
# scripts/docker-engine installs Debian's docker.io where dockerd is missing). Not in
# `make test`: a cold build takes minutes. docs/image.md#the-container-tests
containers: setup
	.venv/bin/python -m pytest -q -m containers

bench: setup
	.venv/bin/python -m benchmarks.bench_codecs
	.venv/bin/python -m benchmarks.bench_exchange

# Builds the image with buildah (no Docker engine; as root) and runs the deployments'
# flows inside it: docs/image.md.
check-image:
	scripts/check-image

# One run across two regions sharing only a bucket and the Prefect API, region B in
# the image when check-image has built it; `make rehearse POOLS=docker`: both regions
# as Docker work pools, every job a container (as root; docs/cross-region.md).
POOLS ?= process
rehearse: setup
	scripts/rehearse-regions --pools $(POOLS)
