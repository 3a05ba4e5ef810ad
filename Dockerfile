# Build stage: compile the release binary (migrations are embedded in it).
# It copies what Cargo.toml's `include` lists, the files building the crate
# reads (tests/it/deploy.rs holds the two together).
FROM rust:1-slim-bookworm AS build
WORKDIR /src
# The commit for bloomgate_build_info (build.rs; the context has no .git):
#   docker build --build-arg BLOOMGATE_COMMIT=$(git rev-parse --short=12 HEAD) .
ARG BLOOMGATE_COMMIT=
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
RUN cargo build --release --locked --bin bloomgate

# Runtime stage: the binary, the config, nothing else.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 bloomgate
COPY --from=build /src/target/release/bloomgate /usr/local/bin/bloomgate
COPY config /etc/bloomgate
USER bloomgate
ENV BLOOMGATE_SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["bloomgate"]
CMD ["serve", "--config", "/etc/bloomgate/bloomgate.toml"]
