# sketchsvd: one image for training, indexing and serving.
#   docker compose up api                       # serve an existing runs/index
#   docker compose --profile train run train    # train (cpu preset) and build runs/index
FROM python:3.11-slim

# CPU wheels by default; pass a CUDA wheel index (e.g. https://download.pytorch.org/whl/cu126)
# and EXTRAS=gpu to build the GPU variant.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OMP_NUM_THREADS=2

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY training ./training
COPY index ./index
COPY service ./service
RUN pip install --extra-index-url "${TORCH_INDEX}" -c constraints.txt ".${EXTRAS:+[$EXTRAS]}" \
    && useradd --create-home --uid 1000 app \
    && mkdir -p /runs && chown app /runs
USER app

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Run from /app so the package's static files (the web page) are next to the code.
CMD ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]
