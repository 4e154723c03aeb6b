# The egress-operator image, for those who build with Docker (or another Dockerfile builder):
#   docker build -t egress-operator:dev .
# `cargo xtask image` builds the same layout without a registry or a Docker daemon, and is what the tests run (under
# crun, as non-root on a read-only root filesystem). Both take their recipe from crates/testenv/src/image.rs (the
# suite, the packages, what is removed, the CA bundle, the binary's path, user and ports); a unit test in
# xtask/src/image.rs fails when this file stops following it. docs/install.md says more.
#
# The runtime image has no shell and no package manager: Debian's libvirt0 (the kvm provider links it) and
# ca-certificates with their dependencies, unpacked but not installed, the CA bundle update-ca-certificates would
# write, and the binary. It runs as UID 65532 and needs a read-only root filesystem only.

FROM rust:1.95-bookworm AS build
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends libvirt-dev pkg-config && rm -rf /var/lib/apt/lists/*
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
 && strip --strip-all -o /egress-operator target/release/egress-operator

# The base layer: the packages and their dependencies unpacked (no maintainer script runs), then what nothing reads
# removed, then the CA bundle as the concatenation of every Mozilla root in file-name order.
FROM debian:bookworm-slim AS rootfs
RUN apt-get update && apt-get install -y --no-install-recommends mmdebstrap && rm -rf /var/lib/apt/lists/*
RUN mmdebstrap --mode=root --quiet --variant=extract --include=libvirt0,ca-certificates bookworm /rootfs \
 && rm -rf /rootfs/etc/apt /rootfs/var/lib/apt /rootfs/var/cache/apt /rootfs/var/lib/dpkg /rootfs/var/log \
      /rootfs/usr/share/doc /rootfs/usr/share/man /rootfs/usr/share/info /rootfs/usr/share/locale \
      /rootfs/usr/share/lintian \
      /rootfs/usr/share/perl5 /rootfs/usr/share/debconf /rootfs/usr/lib/ssl/misc /rootfs/usr/bin/c_rehash \
      /rootfs/usr/bin/debconf /rootfs/usr/bin/debconf-apt-progress /rootfs/usr/bin/debconf-communicate \
      /rootfs/usr/bin/debconf-copydb /rootfs/usr/bin/debconf-escape /rootfs/usr/bin/debconf-set-selections \
      /rootfs/usr/bin/debconf-show /rootfs/usr/sbin/dpkg-preconfigure /rootfs/usr/sbin/dpkg-reconfigure \
      /rootfs/usr/sbin/update-ca-certificates \
 && for cert in $(cd /rootfs/usr/share/ca-certificates/mozilla && LC_ALL=C ls *.crt); do \
      pem=/rootfs/usr/share/ca-certificates/mozilla/$cert; cat "$pem"; [ -z "$(tail -c 1 "$pem")" ] || echo; \
    done > /rootfs/etc/ssl/certs/ca-certificates.crt

FROM scratch
COPY --from=rootfs /rootfs/ /
COPY --from=build /egress-operator /usr/local/bin/egress-operator
USER 65532:65532
WORKDIR /
ENV PATH=/usr/local/bin:/usr/bin:/bin
EXPOSE 8090 8080 8081 8088
ENTRYPOINT ["/usr/local/bin/egress-operator"]
