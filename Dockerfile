# relay and relay-worker as static binaries in an empty image.
#
#   docker build -t relay .
#   docker run -p 8080:8080 -e API_TOKEN=... -e WORKER_TOKEN=... -v relay-data:/data relay
#   docker run -e RELAY_URL=ws://relay:8080/ws -e TOKEN=... --entrypoint /relay-worker relay
#
# The build stage runs the same command as docs/operating.md "Static binaries" (static-pie, LTO, stripped);
# the final image holds the two binaries, an empty /data owned by the unprivileged user, and
# nothing else: no shell, no libc, no CA store (the worker compiles the web PKI roots in).
# Randomness comes from /dev/urandom (a static glibc binary cannot look up getrandom(2) at run
# time), which every container runtime provides. Checked without a Docker engine by running the
# binaries in an empty chroot holding only them, /data and /dev/{null,random,urandom}.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The last three lines refuse to ship a binary that needs a dynamic loader: the image has none.
RUN RUSTFLAGS="-C target-feature=+crt-static" \
      cargo build --release --locked --workspace --target x86_64-unknown-linux-gnu \
 && mkdir -p /out/data \
 && cp target/x86_64-unknown-linux-gnu/release/relay target/x86_64-unknown-linux-gnu/release/relay-worker /out/ \
 && chown 65532:65532 /out/data && chmod 0700 /out/data \
 && ! ldd /out/relay 2>/dev/null | grep -q '=>' \
 && ! ldd /out/relay-worker 2>/dev/null | grep -q '=>' \
 && /out/relay --help >/dev/null

FROM scratch
COPY --from=build /out/relay /relay
COPY --from=build /out/relay-worker /relay-worker
COPY --from=build /out/data /data
USER 65532:65532
ENV BIND=0.0.0.0 \
    PORT=8080 \
    DATA_DIR=/data/journal \
    BLOB_DIR=/data/blobs \
    TOKEN_STORE=/data/tokens.json
EXPOSE 8080
VOLUME ["/data"]
ENTRYPOINT ["/relay"]
