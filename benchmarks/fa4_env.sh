# Source on a GPU machine without FlashAttention 4: unpacks the archives in FOLDER (default .fa4) into /tmp and puts
# them on PYTHONPATH, and in MOESHARD_EXTRA_PATH for scripts that set PYTHONPATH themselves (regimes_1gpu.sh).
#   source benchmarks/gpu_env.sh && source benchmarks/fa4_env.sh .fa4
# The archives hold an installed flash-attn-4 and its needs under fa4site/ (tar -xJf ... -C /tmp gives
# /tmp/fa4site/{flash_attn,quack,tvm_ffi,torch_c_dlpack_ext,nvidia_cutlass_dsl,...}). Built on a machine with pip:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d whl \
#     flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
#     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
#     apache-tvm-ffi torch-c-dlpack-ext
#   for w in whl/*.whl; do unzip -q -o "$w" -d fa4site; done
#   tar -cf - fa4site | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > .fa4/fa4site.tar.xz   # ~55 MB
# (the wheels' .pth file is not read from PYTHONPATH: its folder, dsl_packages, is put on the path here).
_fa4_folder=${1:-.fa4}
for _a in "$_fa4_folder"/*.tar.xz; do tar -xJf "$_a" -C /tmp || return 1; done
export MOESHARD_EXTRA_PATH=":/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH="${PYTHONPATH:-}$MOESHARD_EXTRA_PATH"
python3 -c "import flash_attn.cute" || echo "fa4_env.sh: flash_attn.cute does not import" >&2
unset _fa4_folder _a
