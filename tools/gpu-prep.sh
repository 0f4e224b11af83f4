#!/usr/bin/env bash
# Bundle into .deps/ (git-ignored) what a CUDA machine without the Debian -dev packages or
# network access needs to build and test loom, taken from this machine (where `make deps` ran):
#   headers   Catch2 v2, nlohmann-json, stb, PCRE2, zlib, utf8proc (the build's dependencies),
#             cuDNN's (many CUDA machines have its libraries but not its headers)
#   libraries libpcre2-8, libz, libutf8proc (CMakeLists.txt looks in .deps/lib after the system)
#   data      the Fashion-MNIST files (vit_mim.cfg), ../shared/reference (the PyTorch reference
#             the benchmarks run beside ours) and ../shared/fixtures
# A machine that has the packages needs none of this. Then copy the tree with .deps to the
# CUDA machine and run there:   bash tools/gpu-run.sh [what]   (see that file)
set -euo pipefail
cd "$(dirname "$0")/.."
D=.deps
mkdir -p $D/include $D/lib $D/shared
cp -r /usr/include/catch2 $D/include/
cp -r /usr/include/nlohmann $D/include/
mkdir -p $D/include/stb && cp /usr/include/stb/stb_image.h /usr/include/stb/stb_image_write.h $D/include/stb/ 2>/dev/null || cp /usr/include/stb/stb_image.h $D/include/stb/
cp /usr/include/pcre2.h /usr/include/zlib.h /usr/include/zconf.h $D/include/
[ -f /usr/include/utf8proc.h ] && cp /usr/include/utf8proc.h $D/include/
# cuDNN headers (a CUDA machine may have only the libraries): the attention backend's build
for d in /usr/local/cuda/include /usr/include /usr/include/x86_64-linux-gnu; do
  ls $d/cudnn*.h >/dev/null 2>&1 && { cp $d/cudnn*.h $D/include/; break; }
done
ML=/usr/lib/x86_64-linux-gnu
for l in libpcre2-8.so.0 libz.so.1 libutf8proc.so.2; do
  [ -e $ML/$l ] && cp -L $ML/$l $D/lib/
done
(cd $D/lib && ln -sf libpcre2-8.so.0 libpcre2-8.so && ln -sf libz.so.1 libz.so && { [ -e libutf8proc.so.2 ] && ln -sf libutf8proc.so.2 libutf8proc.so || true; })
mkdir -p $D/fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz $D/fashion-mnist/ 2>/dev/null || echo "no fashion-mnist here (dataset-fashion-mnist)"
rm -rf $D/shared/reference $D/shared/fixtures
cp -r ../shared/reference ../shared/fixtures $D/shared/
chmod -R u+w $D
du -sh $D
