#!/bin/sh
# The image's entry point: the first argument names the role; anything else runs as given.
# exec: the service is PID 1 and gets the SIGTERM of `docker stop` itself (it stops gracefully on it).
role="${1:-core}"
[ $# -gt 0 ] && shift
case "$role" in
    core) exec tridentmq-core "$@" ;;
    gateway-stomp | stomp) exec tridentmq-stomp "$@" ;;
    gateway-mqtt | mqtt) exec tridentmq-mqtt "$@" ;;
    gateway-amqp | amqp) exec tridentmq-amqp "$@" ;;
    *) exec "$role" "$@" ;;
esac
