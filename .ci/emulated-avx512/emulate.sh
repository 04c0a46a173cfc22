#!/usr/bin/env bash
# Run pytest on an emulated AVX-512 CPU: Bochs (Debian's build has AVX-512 and VNNI) as an Intel
# Tiger Lake, booting Debian's kernel. For machines without AVX-512, where the kernels' AVX-512
# build is otherwise never run. Slow (about 24 million instructions a second, one core): pick
# a few tests.
#
#   bash .ci/emulated-avx512/emulate.sh "tests/test_ckernels.py -k avx512"
#
# Exit status: pytest's inside the guest (2: the guest never reported one). The guest's serial
# console is copied to stdout; WORK (default /tmp/poly-avx512) keeps the images and logs.
set -euo pipefail  # STATUS: boots, not yet a working check (README beside this file)
here=$(cd "$(dirname "$0")" && pwd)
TREE=${TREE:-$(cd "$here/../.." && pwd)}
WORK=${WORK:-/tmp/poly-avx512}
TIMEOUT=${TIMEOUT:-5400}
TESTS=${1:-tests/test_ckernels.py -k avx512}
case "$WORK" in /tmp/*) ;; *) echo "WORK must be under /tmp" >&2; exit 2 ;; esac
mkdir -p "$WORK"
need=()
for cmd in bochs-bin:bochs xorriso:xorriso busybox:busybox-static cpio:cpio rsync:rsync tmux:tmux; do
  command -v "${cmd%%:*}" >/dev/null || need+=("${cmd##*:}")
done
[ -e /usr/lib/x86_64-linux-gnu/bochs/plugins/libbx_term_gui.so ] || need+=(bochs-term)
[ -e /usr/lib/ISOLINUX/isolinux.bin ] || need+=(isolinux syslinux-common)
[ -e /usr/share/bochs/BIOS-bochs-latest ] || need+=(bochsbios vgabios)
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Debian's kernel: vmlinuz and the disk modules, unpacked once
kdir="$WORK/kernel"
if [ ! -d "$kdir/boot" ]; then
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  echo "== fetching $pkg"
  (cd "$WORK" && apt-get download "$pkg" 2>/dev/null)
  mkdir -p "$kdir"
  dpkg-deb --fsys-tarfile "$WORK/$pkg"_*.deb | tar -x -C "$kdir" ./boot --wildcards \
    './lib/modules/*/kernel/drivers/ata/*' './lib/modules/*/kernel/drivers/scsi/*.ko' \
    './lib/modules/*/kernel/lib/*' './lib/modules/*/kernel/crypto/*' './lib/modules/*/kernel/block/*'
  rm -f "$WORK/$pkg"_*.deb
fi
echo "== building the guest"
TREE="$TREE" OUT="$WORK/out" TESTS="$TESTS" KERNEL=$(ls "$kdir"/boot/vmlinuz-*) \
  KMODS=$(ls -d "$kdir"/lib/modules/*/kernel) bash "$here/build.sh" >/dev/null
sed "s#@OUT@#$WORK/out#g" "$here/bochsrc.in" > "$WORK/bochsrc"
echo c > "$WORK/debugger.rc"  # Debian's bochs starts in its debugger: continue
serial="$WORK/out/serial.txt"
rm -f "$serial"
session="poly-avx512-$$"
# the term display needs a terminal (tmux), and draws on a pty of its own: bochs stops when
# nobody reads that pty, so a cat drains it
tmux new-session -d -s "$session" -x 100 -y 30 "cd '$WORK' && bochs -q -f bochsrc -rc debugger.rc"
drain=""
trap 'tmux kill-session -t "$session" 2>/dev/null || true; [ -z "$drain" ] || kill "$drain" 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  pts=$(tmux capture-pane -p -S -1000 -t "$session" 2>/dev/null |
    sed -n 's#.*connected to screen "\(/dev/pts/[0-9]*\)".*#\1#p' | tail -1)
  [ -n "$pts" ] && break
  sleep 1
done
[ -n "$pts" ] || { echo "== bochs did not start its display" >&2; exit 2; }
cat "$pts" > "$WORK/out/screen.txt" 2>/dev/null &
drain=$!
start=$(date +%s)
echo "== booting (Bochs, tigerlake); serial console: $serial"
while tmux has-session -t "$session" 2>/dev/null; do
  grep -q "== guest done" "$serial" 2>/dev/null && break
  if [ $(($(date +%s) - start)) -gt "$TIMEOUT" ]; then echo "== timeout after $TIMEOUT s"; break; fi
  sleep 5
done
tmux kill-session -t "$session" 2>/dev/null || true
echo "== host seconds: $(($(date +%s) - start))"
tr -d '\r' < "$serial" 2>/dev/null | grep -v "^\s*$" || true
rc=$(tr -d '\r' < "$serial" 2>/dev/null | sed -n 's/^== pytest exit \([0-9]*\).*/\1/p' | tail -1)
exit "${rc:-2}"
