"""Input checks compiled into every AOTInductor package: a call whose inputs do not have the shapes, dtypes or
strides the package was compiled for raises RuntimeError naming the given and the expected shape, instead of
returning a wrong-shaped result or aborting the process (an out-of-bounds read on a shorter sequence).

torch 2.14.1's AOTInductor generates such checks already, but runs them only when the serving process sets
AOTI_RUNTIME_CHECK_INPUTS=1, and they name one dim, not the shapes. A package must work in a process that has only
torch, so the checks cannot live in Python: while export compiles, ``compiled_in(hint)`` replaces the C++ function
the generated ``run_impl`` calls first (``__check_inputs_outputs``) with one that always checks:

* the number of dims, every static size, the range of every dynamic size (the lower bound 2 that torch.export's
  0/1 specialisation records is taken as 1: the code compiled for a symbolic size also serves size 1), and that
  dims which share a symbol (``input_ids`` and ``attention_mask`` of one sequence length) are equal;
* dtype, the CPU device, and the strides of every dim longer than 1 (the kernels index with the compiled strides);
* the message: ``input 0 has shape (4, 48) and dtype int64; the package was compiled for shape (any, 32) and
  dtype int64: dim 1 is 48, expected 32.`` plus ``hint`` (what export to run for other shapes).

``MARKER`` is written into the generated source, which the package keeps; export verifies it is there
(``verify``), so a torch whose wrapper code no longer calls this hook fails at export, not at serving time.
"""
from __future__ import annotations

import contextlib
import json
import zipfile

import sympy
import torch

MARKER = "ipex_train input checks v1"

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _c_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)  # a JSON string of ASCII text is a valid C++ string literal


def _range(expr, var_to_range):
    from torch.utils._sympy.value_ranges import bound_sympy

    bounds = bound_sympy(expr, var_to_range)
    lo, hi = _finite(bounds.lower), _finite(bounds.upper)
    # 2 is the bound torch.export's 0/1 specialisation records (the code serves size 1 too); size 0 is refused
    return (1 if lo is None or lo <= 2 else lo), hi


def _finite(value):
    if isinstance(value, sympy.Expr) and not value.is_Integer:
        return None  # sympy's and torch's infinities (torch's int_oo says is_finite)
    value = int(value)
    return value if abs(value) < 2**62 else None


def _describe(size, var_to_range) -> str:
    """"(any, 32)" for the sizes of one input: ints as they are, a dynamic size as its range."""
    parts = []
    for s in size:
        if isinstance(s, (int, sympy.Integer)):
            parts.append(str(int(s)))
            continue
        lo, hi = _range(s, var_to_range)
        parts.append("any" if lo <= 1 and hi is None else f">={lo}" if hi is None else f"{lo}..{hi}")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


class _Emitter:
    """C++ for the checks of one compiled graph."""

    def __init__(self, graph, hint: str):
        from torch._inductor.codegen.cpp_utils import cexpr

        self.cexpr, self.hint = cexpr, hint
        self.var_to_range = graph.sizevars.shape_env.var_to_range
        self.bound = {}  # symbol -> (C++ variable, "dim d of input i") where it was first read
        self.lines = []

    def var(self, symbol) -> str:
        return f"ipx_{symbol.name}"

    def value(self, expr):
        """C++ for ``expr`` when every symbol in it was read from an input already, else None."""
        if isinstance(expr, (int, sympy.Integer)):
            return str(int(expr))
        if not all(s in self.bound for s in expr.free_symbols):
            return None
        return self.cexpr(expr.subs({s: sympy.Symbol(self.var(s), integer=True) for s in expr.free_symbols}))

    def fail(self, index: int, condition: str, detail_cpp: str):
        self.lines.append(f"    if ({condition}) ipx_fail(h, {index}, expected, {detail_cpp});")

    def input(self, index: int, tensor) -> None:
        size, stride, dtype = list(tensor.get_size()), list(tensor.get_stride()), tensor.get_dtype()
        dtype_name = str(dtype).removeprefix("torch.")
        expected = f"{_describe(size, self.var_to_range)} and dtype {dtype_name}"
        self.lines += [f"  {{  // input {index}", f"    AtenTensorHandle h = input_handles[{index}];",
                       f"    const char* expected = {_c_string(expected)};",
                       "    int64_t ndim; AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &ndim));"]
        self.fail(index, f"ndim != {len(size)}", f'"it has " + std::to_string(ndim) + " dims, expected {len(size)}"')
        self.lines += ["    int64_t* sz; AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &sz));",
                       "    int64_t* st; AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, &st));",
                       "    int32_t dt; AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &dt));",
                       "    int32_t dev; AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &dev));"]
        self.fail(index, f"dt != aoti_torch_dtype_{dtype_name}()", f'"the dtype is not {dtype_name}"')
        self.fail(index, "dev != aoti_torch_device_type_cpu()", '"it is not a CPU tensor"')
        for d, s in enumerate(size):
            self.dim(index, d, s)
        layout = "(" + ", ".join(str(int(t)) if isinstance(t, (int, sympy.Integer)) else "*" for t in stride) + \
            ("," if len(stride) == 1 else "") + ")"
        for d, t in enumerate(stride):
            want = self.value(t)
            if want is not None:
                self.fail(index, f"sz[{d}] > 1 && st[{d}] != {want}",
                          f'"its strides are " + ipx_tuple(st, ndim) + ", the package was compiled for strides '
                          f'{layout}, the example\'s layout (x.contiguous() makes a contiguous copy)"')
        self.lines.append("  }")

    def dim(self, index: int, d: int, s) -> None:
        if isinstance(s, sympy.Symbol) and s not in self.bound:
            lo, hi = _range(s, self.var_to_range)
            self.bound[s] = (self.var(s), f"dim {d} of input {index}")
            self.lines.append(f"    {self.var(s)} = sz[{d}];")  # declared at the top: later inputs compare to it
            self.fail(index, f"sz[{d}] < {lo}", f'"dim {d} is " + std::to_string(sz[{d}]) + ", expected at least {lo}"')
            if hi is not None:
                self.fail(index, f"sz[{d}] > {hi}",
                          f'"dim {d} is " + std::to_string(sz[{d}]) + ", expected at most {hi}"')
            return
        want = self.value(s)
        if want is None:  # a size computed from symbols no input dim gives: left to the compiled code
            return
        if isinstance(s, sympy.Symbol):
            where = self.bound[s][1]
            if where == f"dim {d} of input {index}":
                return
            detail = f'"dim {d} is " + std::to_string(sz[{d}]) + ", expected {where}\'s size " + std::to_string({want})'
        else:
            detail = f'"dim {d} is " + std::to_string(sz[{d}]) + ", expected " + std::to_string({want})'
        self.fail(index, f"sz[{d}] != {want}", detail)

    def code(self, inputs) -> str:
        for index, tensor in inputs:
            self.input(index, tensor)
        dtype_names = "\n".join(f'    if (dt == aoti_torch_dtype_{n}()) return "{n}";' for n in _DTYPES)
        hint = _c_string(" " + self.hint if self.hint else "")
        return f"""
            // {MARKER}: always on (a package must refuse shapes it was not compiled for in any process)
            static std::string ipx_tuple(const int64_t* v, int64_t n) {{
                std::string s = "(";
                for (int64_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
                return s + (n == 1 ? ",)" : ")");
            }}
            static const char* ipx_dtype(int32_t dt) {{
            {dtype_names}
                return "another dtype";
            }}
            [[noreturn]] static void ipx_fail(AtenTensorHandle h, int index, const char* expected,
                                              const std::string& detail) {{
                int64_t ndim = 0; int64_t* sz = nullptr; int32_t dt = -1;
                aoti_torch_get_dim(h, &ndim); aoti_torch_get_sizes(h, &sz); aoti_torch_get_dtype(h, &dt);
                throw std::runtime_error("AOTInductor package: input " + std::to_string(index) + " has shape " +
                    ipx_tuple(sz, ndim) + " and dtype " + ipx_dtype(dt) + "; the package was compiled for shape " +
                    expected + ": " + detail + "." + {hint});
            }}
            // the generated code's own intermediate asserts stay behind torch's switch, as in stock packages
            static bool _check_aoti_runtime_check_inputs_env() {{
                const static char* value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
                const static bool result = value != nullptr && value[0] != '0';
                return result;
            }}
            AOTI_NOINLINE static void __check_inputs_outputs(
                AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {{
            """ + "".join(f"  int64_t {var} = 0;\n" for var, _ in self.bound.values()) + "\n".join(self.lines) + "\n}\n"


@contextlib.contextmanager
def compiled_in(hint: str = ""):
    """While active, AOTInductor packages compiled in this thread carry the always-on input checks; ``hint`` ends
    their error message."""
    from torch._inductor import ir
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

    def generate(wrapper):
        inputs = [(i, t) for i, t in enumerate(V.graph.graph_inputs.values()) if isinstance(t, ir.TensorBox)]
        wrapper.prefix.splice_aot(_Emitter(V.graph, hint).code(inputs))

    original = CppWrapperCpu.generate_input_output_runtime_checks
    CppWrapperCpu.generate_input_output_runtime_checks = generate
    try:
        yield
    finally:
        CppWrapperCpu.generate_input_output_runtime_checks = original


def verify(path) -> bool:
    """Whether the package at ``path`` was compiled with these checks (its generated C++ source holds MARKER)."""
    with zipfile.ZipFile(path) as z:
        return any(name.endswith(".wrapper.cpp") and MARKER.encode() in z.read(name) for name in z.namelist())


def expected_shapes(ep) -> str:
    """"input0 (any, 32) int64, ..." for an ExportedProgram's user inputs (its range constraints)."""
    ranges, out = ep.range_constraints, []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in ep.graph_signature.user_inputs:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                size = [s.node.expr if isinstance(s, torch.SymInt) else s for s in val.shape]
                out.append(f"input{len(out)} {_describe(size, ranges)} {str(val.dtype).removeprefix('torch.')}")
    return ", ".join(out)
