#!/bin/sh
# The image's entrypoint: `kvserve serve` with the container's arguments.
#
# Started as a non-root user (the image's default, Kubernetes), it runs kvserve as that
# user. Started as root (docker compose does, to use the host's Hugging Face cache), it
# runs kvserve as the owner of the cache at $HF_HOME, so a Hub download lands in the
# host's cache as the host user's files, whatever that user's uid:
#   - owned by a non-root uid: that uid and gid;
#   - owned by root and empty (Docker made the missing host folder): given to the image's
#     user, 10001, which runs kvserve;
#   - owned by root with files in it (the host user is root): root, said on stderr.
set -eu

if [ "$(id -u)" != 0 ]; then
    exec kvserve serve "$@"
fi

cache=${HF_HOME:-/hf}
mkdir -p "$cache"
uid=$(stat -c %u "$cache")
gid=$(stat -c %g "$cache")
if [ "$uid" = 0 ] && [ -z "$(ls -A "$cache")" ]; then
    chown 10001:10001 "$cache"
    uid=10001 gid=10001
fi
if [ "$uid" = 0 ]; then
    echo "kvserve-entrypoint: $cache belongs to root: kvserve runs as root" >&2
    exec kvserve serve "$@"
fi

# a home the user can write: the C kernels' and Triton's build caches live under it
if [ "$uid" = 10001 ]; then
    home=/home/kvserve
else
    home=/tmp/kvserve-home
    mkdir -p "$home" && chown "$uid:$gid" "$home"
fi
echo "kvserve-entrypoint: $cache belongs to $uid:$gid: kvserve runs as $uid:$gid" >&2
exec env HOME="$home" setpriv --reuid="$uid" --regid="$gid" --clear-groups -- kvserve serve "$@"
