# Multi-stage build of the egress-operator image. It cannot be built on the project's CI machines (no Docker
# engine there); build it where Docker or another OCI builder runs:
#   docker build -t egress-operator:dev .
# The runtime image is Debian slim with libvirt's client library (the kvm provider links it) and CA roots; it runs
# as UID 65532 and needs a read-only root filesystem only.

FROM rust:1.95-bookworm AS build
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends libvirt-dev pkg-config && rm -rf /var/lib/apt/lists/*
# Dependencies first, so source edits do not rebuild them: fetch with the lockfile, then build the workspace.
COPY Cargo.toml Cargo.lock rust-toolchain.toml ./
COPY .cargo .cargo
COPY bins bins
COPY crates crates
COPY xtask xtask
COPY crds crds
COPY docs docs
RUN cargo fetch --locked
ARG EGRESS_GIT_COMMIT=unknown
ENV EGRESS_GIT_COMMIT=${EGRESS_GIT_COMMIT}
RUN cargo build --release --locked -p egress-operator \
 && cp target/release/egress-operator /egress-operator

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libvirt0 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /egress-operator /usr/local/bin/egress-operator
USER 65532:65532
EXPOSE 8090 8080 8081
ENTRYPOINT ["/usr/local/bin/egress-operator"]
