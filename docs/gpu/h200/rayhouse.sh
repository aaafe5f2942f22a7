# Ray 2.60.0 for the GPU machine's Python 3.12, with the base dependencies its image lacks (click,
# jsonschema and its three, msgpack, protobuf, attrs), as two parts under .gpuray/ that calls carry
# one at a time (64 MiB a call) into /tmp/rayparts; install-ray.sh there checks the sums and installs
# into /tmp/xray (run_multimodel.sh and run_flood.sh put it on PYTHONPATH).
#   bash docs/gpu/h200/rayhouse.sh   (from the repository root; needs PyPI)
set -euo pipefail
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dl" ray==2.60.0 click jsonschema jsonschema-specifications referencing rpds-py msgpack protobuf attrs
rm -rf .gpuray && mkdir -p .gpuray/part0 .gpuray/part1
(cd "$dl" && sha256sum ./*.whl > sums.txt && tar cf wheels.tar ./*.whl sums.txt && split -n 2 -d wheels.tar wheels.tar.)
mv "$dl/wheels.tar.00" .gpuray/part0/ && mv "$dl/wheels.tar.01" .gpuray/part1/
cat > .gpuray/part0/install-ray.sh <<'INSTALL'
set -euo pipefail
cd /tmp/rayparts && cat wheels.tar.00 wheels.tar.01 > /tmp/rayparts-wheels.tar
mkdir -p /tmp/raywheels && tar xf /tmp/rayparts-wheels.tar -C /tmp/raywheels
(cd /tmp/raywheels && sha256sum -c sums.txt)
python3 -m pip install -q --no-index --no-deps --target /tmp/xray /tmp/raywheels/*.whl
touch /tmp/xray/.installed
INSTALL
du -sh .gpuray/*
