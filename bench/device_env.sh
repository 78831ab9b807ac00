# Source this first on a lent GPU machine (run from the repo root, with `.whl` carried):
#   source bench/device_env.sh && python3 bench/storage.py
# It installs the carried wheels (zarr and friends are not in that image) into /tmp/site and makes the
# checkout importable as `dflash` whatever its folder is called. Refill .whl/ here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 xxhash==4.1.0 gguf==0.19.0
# (gguf: the demo converts the embedded GGUF with it), and for bench/targets.py's hybrid target the same way:
#   flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 (transformers runs Gated DeltaNet on its kernels),
# and pytest-xdist==3.8.0 execnet==2.1.2 for `pytest -m gpu` there (pyproject's addopts pass -n 2)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/dflash
export PYTHONPATH=/tmp/site:/tmp/pkgs${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The lent image's site-packages hold no bytecode that this interpreter can use, so every interpreter compiled torch,
# sympy and numpy from source: 8.7 s of `dflash extract`'s start-up on 2026-12-02 (py-spy). A pip install writes
# the bytecode once; a cache folder does the same here, from the second interpreter on.
export PYTHONPYCACHEPREFIX=/tmp/pycache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
