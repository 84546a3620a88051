# sketchsvd: one image for training, indexing and serving, in two variants (build arg VARIANT):
#   cpu (default)  CPU-only torch wheels                        docker build -t sketchsvd:cpu .
#   gpu            PyPI's Linux torch wheels, built with CUDA   docker build --build-arg VARIANT=gpu -t sketchsvd:gpu .
# Both search with faiss-cpu (pyproject.toml). docker-compose.yml runs the services.
# For hosts that reach neither Docker Hub nor the torch index (docs/deployment.md):
#   BASE_IMAGE   an image of Python 3.11 or later (the build reads pyproject.toml with tomllib)
#                with `python` and `pip` on PATH (deploy/local-base.sh makes one with debootstrap)
#   TORCH_INDEX  an extra package index for torch: a URL, or file://DIR/simple for a folder
#                index mounted for the build only (`podman build -v HOST_FOLDER:DIR:ro`); pip
#                takes equal versions from it rather than from PyPI. "": PyPI alone
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=2 \
    TORCH_HOME=/cache/torch
# The user every service runs as owns each folder they write: /runs (checkpoints, index) and
# /cache (feature cache, torch hub). A new named volume mounted on them takes this owner.
RUN useradd --create-home --uid 1000 --user-group app \
    && mkdir -p /runs /cache \
    && chown app:app /runs /cache
WORKDIR /app
# Dependencies from pyproject.toml alone: the layers that install them (torch included) are
# rebuilt when pyproject.toml, constraints.txt or VARIANT change, not when the code does.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(p['build-system']['requires'] + p['project']['dependencies']))" > requirements.txt

ARG VARIANT=cpu
# default: the CPU-only wheel index for cpu; PyPI alone for gpu
ARG TORCH_INDEX=default
# cpu: torch from the CPU-only index, a fraction of the CUDA wheels' size. gpu: PyPI's Linux
# torch, whose CUDA libraries come as nvidia-* wheels; the host needs an NVIDIA driver recent
# enough for that CUDA release and the NVIDIA Container Toolkit.
RUN case "${VARIANT}:${TORCH_INDEX}" in \
      cpu:default) set -- --extra-index-url https://download.pytorch.org/whl/cpu ;; \
      gpu:default) set -- ;; \
      cpu:*|gpu:*) set -- ${TORCH_INDEX:+--extra-index-url "${TORCH_INDEX}"} ;; \
      *) echo "VARIANT must be cpu or gpu, got '${VARIANT}'" >&2; exit 1 ;; \
    esac \
    && pip install "$@" -c constraints.txt -r requirements.txt

# The code last: a change to it rebuilds only the layers from here on. The packages only:
# research/, benchmarks/ and tests/ stay out of the image.
COPY README.md ./
COPY training ./training
COPY index ./index
COPY service ./service
RUN pip install --no-deps --no-build-isolation .
# app, by number so that a runtime can check it is not root
USER 1000:1000

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=8)"]
# Run from /app so the package's static files (the web page) are next to the code.
CMD ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]
