# Build stage: compile the release binary (migrations are embedded in it).
FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
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
