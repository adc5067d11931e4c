# Environment for the SYCL CPU device of a virtual environment holding the `xpu` extra (dpctl, intel-opencl-rt).
#
#   . kernels_xpu/sycl_env.sh /path/to/venv      (or with $VIRTUAL_ENV set: . kernels_xpu/sycl_env.sh)
#
# - OCL_ICD_VENDORS: the wheel's etc/OpenCL/vendors/intel-cpu.icd names a placeholder path, so the OpenCL ICD
#   loader would find no driver. A private vendors folder with one .icd naming the venv's libintelocl.so fixes that
#   and keeps other ICDs out (Debian's pocl shows up as a device without USM).
# - LD_LIBRARY_PATH: the wheel's libOpenCL needs libsvml and has no RUNPATH; Python code finds it without this
#   (ipex_train.xpu sets OCL_ICD_VENDORS itself when unset), but plain C++ programs and tools do not.
# - SYCL_CACHE_PERSISTENT must stay unset: the on-disk cache segfaults with run-time-compiled kernel bundles.
_itx_venv="${1:-${VIRTUAL_ENV:-}}"
if [ -z "$_itx_venv" ] || [ ! -e "$_itx_venv/lib/libintelocl.so" ]; then
  echo "sycl_env.sh: no lib/libintelocl.so under '${_itx_venv}'; pass the venv path, after: pip install dpctl intel-opencl-rt" >&2
  unset _itx_venv
  return 1 2>/dev/null || exit 1
fi
_itx_venv="$(cd "$_itx_venv" && pwd -P)"
mkdir -p "$_itx_venv/etc/ipex_train-opencl-vendors"
printf '%s\n' "$_itx_venv/lib/libintelocl.so" > "$_itx_venv/etc/ipex_train-opencl-vendors/intel-cpu.icd"
export OCL_ICD_VENDORS="$_itx_venv/etc/ipex_train-opencl-vendors"
case ":${LD_LIBRARY_PATH:-}:" in
  *":$_itx_venv/lib:"*) ;;
  *) export LD_LIBRARY_PATH="$_itx_venv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
unset SYCL_CACHE_PERSISTENT _itx_venv
