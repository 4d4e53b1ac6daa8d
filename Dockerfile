# syntax=docker/dockerfile:1
# The hps image: `hps serve` for every tier (deploy/k8s), with CPU-only torch (the root's
# optimizer; relays never import it).
#   docker build -t hps:0.1.0 .
#   docker run --rm -p 7000:7000 -p 9100:9100 -e HPS_ROLE=global -e HPS_LISTEN=0.0.0.0:7000 \
#       -e HPS_METRICS_PORT=9100 hps:0.1.0
# Python matches the development venv (3.11); every `hps serve` flag reads HPS_<FLAG>.

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/hps
ENV PATH=/opt/hps/bin:$PATH
# torch first, pinned, from the CPU index: a loose torch pulls gigabytes of CUDA wheels. Its
# own layer, so changes to the project do not download it again.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY . .
# Generated protobuf code is never committed (.dockerignore drops any local copy): the wheel
# build generates it (setup.py; grpcio-tools lives only in pip's isolated build environment, so
# the image carries no build tool and no demo extras). uvloop: `hps serve --loop uvloop`.
# constraints.txt pins every dependency (deploy/gen_constraints.py): a rebuild of the same commit
# installs the same versions, not whatever the registry holds that day.
RUN pip install ".[uvloop]" -c constraints.txt \
 && cd / && python -c "import ps.net.proto.hps_pb2, ps.server, ps.server.health" \
 && python -c "import importlib.util as u; assert u.find_spec('grpc_tools') is None and u.find_spec('matplotlib') is None"

FROM python:3.11-slim-bookworm
COPY --from=build /opt/hps /opt/hps
ENV PATH=/opt/hps/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# glibc unmaps every >= 32 MiB buffer on free, so each large message faults its pages in anew:
# keep freed memory in the heap instead (what `hps launch` sets; measured 2x faster gRPC pushes
# and pulls of a 400 MB model in benchmarks/dataplane.py).
ENV MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_TOP_PAD_=67108864
# The uid the Kubernetes manifests run as (runAsUser: 10001).
RUN groupadd --gid 10001 hps && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent hps
USER 10001:10001
# gRPC (every tier) and /metrics.
EXPOSE 7000 9100
# Exec form: hps is PID 1 and gets SIGTERM itself -- readiness goes NOT_SERVING, the root
# writes a final checkpoint, relays leave their parent (ps/server/lifecycle.py).
ENTRYPOINT ["hps"]
CMD ["serve"]
