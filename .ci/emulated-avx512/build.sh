#!/usr/bin/env bash
# Build what Bochs boots to run TESTS on an emulated AVX-512 CPU:
#   OUT/boot.iso     isolinux, the Debian kernel, a small initrd (busybox, the ATA disk modules)
#   OUT/payload.img  a cpio archive of the guest's root (python, the venv's packages, the tree)
# The initrd's init reads the payload off the disk into a tmpfs, chroots there and runs
# /run.sh, whose lines go to the serial port.
set -euo pipefail
: "${TREE:?}" "${OUT:?}" "${KERNEL:?}" "${KMODS:?}"
VENV=${VENV:-/work/venv}
TESTS=${TESTS:-tests/test_ckernels.py}
PY=$(readlink -f "$VENV/bin/python3")
PYHOME=$(dirname "$(dirname "$PY")")
SITE="$VENV/lib/python3.11/site-packages"
case "$OUT" in /tmp/*) ;; *) echo "OUT must be under /tmp" >&2; exit 2 ;; esac
rm -rf "$OUT" && mkdir -p "$OUT/root"
R="$OUT/root"
mkdir -p "$R"/{bin,proc,sys,dev,tmp,etc,root}
cp /bin/busybox "$R/bin/busybox"
mkdir -p "$R$PYHOME/bin" "$R$PYHOME/lib"
cp -a "$PYHOME/bin/python3.11" "$R$PYHOME/bin/" && ln -s python3.11 "$R$PYHOME/bin/python3"
cp -a "$PYHOME"/lib/libpython3.11.so* "$R$PYHOME/lib/"
rsync -a --exclude site-packages --exclude test --exclude tests --exclude idlelib --exclude tkinter \
  --exclude turtledemo --exclude ensurepip --exclude lib2to3 --exclude config-3.11-x86_64-linux-gnu \
  "$PYHOME/lib/python3.11" "$R$PYHOME/lib/"
mkdir -p "$R$VENV/bin" "$R$SITE"
cp -a "$VENV/pyvenv.cfg" "$R$VENV/" && cp -a "$VENV"/bin/python* "$R$VENV/bin/"
rsync -a --exclude 'torch*' --exclude 'transformers*' --exclude 'llvmlite*' --exclude 'numba*' \
  --exclude 'sympy*' --exclude 'llama_cpp*' --exclude 'openai*' --exclude 'networkx*' --exclude 'uvloop*' \
  --exclude 'hf_xet*' --exclude 'pip' --exclude 'pip-*' --exclude 'mpi4py*' --exclude 'llguidance*' \
  --exclude 'grimp*' --exclude 'mpmath*' --exclude '/lib' --exclude 'nvidia*' --exclude 'triton*' \
  --exclude 'pygments*' --exclude 'huggingface_hub*' --exclude 'setuptools*' --exclude '__editable__*' \
  --exclude 'accelerate*' --exclude 'fastapi*' --exclude 'starlette*' --exclude 'uvicorn*' \
  "$SITE/" "$R$SITE/"
mkdir -p "$R/work/main"
rsync -a --exclude .git --exclude build --exclude 'benchmarks/results' --exclude '*.egg-info' \
  "$TREE/" "$R/work/main/"
"$PY" -m compileall -q -j 1 "$R/work/main/poly" "$R/work/main/entity" "$R/work/main/tests" \
  "$R/work/main/lucy" >/dev/null || true
find "$R" -type f \( -name '*.so' -o -name '*.so.*' -o -path "*/bin/python3.11" \) -print0 |
  xargs -0 -n 20 ldd 2>/dev/null | awk '/=> \//{print $3}' | sort -u > "$OUT/libs.txt"
while read -r lib; do
  [ -e "$R$lib" ] && continue
  mkdir -p "$R$(dirname "$lib")" && cp -L "$lib" "$R$lib"
done < "$OUT/libs.txt"
mkdir -p "$R/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib64/"
sed -e "s#@VENV@#$VENV#g" -e "s#@TESTS@#$TESTS#g" "$(dirname "$0")/run.sh.in" > "$R/run.sh"
(cd "$R" && find . | cpio -o -H newc --quiet) > "$OUT/payload.img"
truncate -s %1048576 "$OUT/payload.img"
B="$OUT/boot"
mkdir -p "$B"/{bin,proc,sys,dev,new,mod}
cp /bin/busybox "$B/bin/"
MODS="crct10dif_common crct10dif_generic crc-t10dif crc64 crc64_rocksoft_generic crc64-rocksoft t10-pi"
MODS="$MODS scsi_common scsi_mod libata ata_piix sd_mod"
for m in $MODS; do cp "$(find "$KMODS" -name "$m.ko" | head -1)" "$B/mod/"; done
sed -e "s#@MODS@#$MODS#g" "$(dirname "$0")/init.in" > "$B/init"
chmod +x "$B/init"
mkdir -p "$OUT/iso"
(cd "$B" && find . | cpio -o -H newc --quiet) > "$OUT/iso/initrd"
cp "$KERNEL" "$OUT/iso/vmlinuz"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$OUT/iso/"
printf '%s\n' "DEFAULT linux" "PROMPT 0" "TIMEOUT 0" "LABEL linux" "  KERNEL /vmlinuz" \
  "  APPEND initrd=/initrd console=ttyS0,115200 rdinit=/init ignore_loglevel mitigations=off nokaslr" \
  > "$OUT/iso/isolinux.cfg"
xorriso -as mkisofs -quiet -o "$OUT/boot.iso" -b isolinux.bin -c boot.cat -no-emul-boot \
  -boot-load-size 4 -boot-info-table "$OUT/iso"
du -sh "$OUT/payload.img" "$OUT/boot.iso"
