# One image for the api, the worker and the MLflow server; docker-compose.yml picks the command.
# torch's CUDA build and TensorFlow's CUDA libraries come as wheels from the package index, so the
# base is plain Python: the GPU driver is the host's, handed in by the NVIDIA Container Toolkit.
# Versions: constraints.txt (the lock, `make lock`), the same one the Makefile installs.
FROM python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, in their own layer (several GB): a change to the source alone reuses it.
# The list is pyproject.toml's own (dependencies and the `gpu` extra), held to the lock; torch==2.13.0
# from the index is its CUDA build.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself (its dependencies are all in the layer above).
COPY README.md ./
COPY service ./service
COPY jobs ./jobs
COPY optimizers ./optimizers
COPY examples ./examples
RUN pip install --no-deps -c constraints.txt . \
    && groupadd --gid 10001 optlab \
    && useradd --create-home --uid 10001 --gid 10001 optlab \
    && mkdir -p /data /checkpoints /datasets /plugins /mlartifacts \
    && chown optlab:optlab /data /checkpoints /datasets /plugins /mlartifacts

USER 10001:10001
ENV OPTLAB_DATA_DIR=/data

# Alive, not ready: the api's compose healthcheck asks /readyz; the worker and MLflow set their own
# (a worker started with `docker run` needs --no-healthcheck: README "More GPU hosts").
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('OPTLAB_API_PORT', '8000') + '/healthz', timeout=4)"]

EXPOSE 8000 5000
CMD ["optlab", "api"]
