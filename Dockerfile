# swarmd in a container. CPU by default; a CUDA build of torch with --build-arg CUDA=12.4
# (one of: cpu 11.8 12.1 12.4 12.6 12.8; another stops the build with that list).
#   docker build -t swarmd .                         # CPU
#   docker build -t swarmd:cuda --build-arg CUDA=12.4 .
#   docker run -d --name swarmd -p 31337:31337 -v swarmd-home:/home/swarmd/.swarmd \
#       swarmd join --bootstrap /ip4/HOST/tcp/31337/p2p/PEER_ID
# (GPU: add --gpus all.) The home (identity key, config, checkpoints) lives in the volume.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG CUDA=cpu
# libp2p pins fastecdsa, which compiles against GMP
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgmp-dev \
    && rm -rf /var/lib/apt/lists/*
COPY tools/docker_torch.sh /tmp/docker_torch.sh
RUN sh /tmp/docker_torch.sh "$CUDA"
COPY . /src
RUN pip install --no-cache-dir /src \
    && rm -rf /src \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y
COPY tools/docker-entrypoint.sh /usr/local/bin/swarmd-entrypoint
RUN useradd --create-home --uid 1000 swarmd
USER swarmd
ENV SWARMD_HOME=/home/swarmd/.swarmd PYTHONUNBUFFERED=1 \
    SWARMD_NETWORK_LISTEN=/ip4/0.0.0.0/tcp/31337
VOLUME /home/swarmd/.swarmd
EXPOSE 31337
STOPSIGNAL SIGTERM
ENTRYPOINT ["swarmd-entrypoint"]
CMD ["join"]
