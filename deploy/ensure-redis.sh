#!/bin/sh
# Make sure a Redis server answers at 127.0.0.1:6379: the tests run against a real one.
# Starts one (no persistence) if none answers, installing the Debian package if needed.
set -eu
HOST=127.0.0.1
PORT=${REWA_TEST_REDIS_PORT:-6379}

answers() {
    redis-cli -h "$HOST" -p "$PORT" ping 2>/dev/null | grep -q PONG
}

if command -v redis-cli >/dev/null 2>&1 && answers; then
    exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server
fi
redis-server --daemonize yes --bind "$HOST" --port "$PORT" --save "" --appendonly no
for _ in $(seq 50); do
    if answers; then exit 0; fi
    sleep 0.1
done
echo "ensure-redis: no Redis server answers at $HOST:$PORT" >&2
exit 1
