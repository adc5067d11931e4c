// Host glue of kernels_xpu: the Python module ipex_train._xpu_C (built on first use by ipex_train.xpu with
// torch.utils.cpp_extension.load, g++ against intel-sycl-rt's headers and libsycl; no SYCL compiler involved).
//
// It compiles kernels_xpu/rtc/steps.cpp at run time with SYCL-RTC (one bundle per element type and one for
// reduced-byte optimizer state, cached in the Runtime for the life of the process), checks that every pointer it is
// handed is USM memory of the queue's context, computes the per-parameter coefficients (and rounding keys) with the
// same header functions kernels_cpu uses, and launches one kernel per parameter. Argument checks on dtypes and
// shapes are done in Python (ipex_train/xpu/_steps.py) before anything reaches this file. The step methods are
// bound, and their kernels named, from the lists in kernels_cpu/src/optimizers.h and the fused:: entries of the
// update headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sycl/sycl.hpp>

#include "dpctl4pybind11.hpp"
#include "kernel_abi.h"
#include "step_args.h"

namespace py = pybind11;
namespace syclex = sycl::ext::oneapi::experimental;

namespace ipex_train {
namespace xpu {
namespace {

// Work-group size of every launch (lowered to what the device or kernel allows): a multiple of every GPU's SIMD
// width and small enough for any device; on the CPU device the runtime vectorizes across the work-items.
constexpr size_t kGroup = 256;

// Round exactly as kernels_cpu does, which makes the results on the SYCL CPU device bit-identical to the CPU
// kernels: no fused multiply-adds the source did not ask for (kernels_cpu is built with -ffp-contract=off), and
// correctly rounded fp32 sqrt and division (a GPU's default would be faster approximations).
const std::vector<std::string> kBuildOptions = {"-ffp-contract=off", "-foffload-fp32-prec-sqrt",
                                                "-foffload-fp32-prec-div"};

// One parameter as Python hands it over: layout, element count, the addresses of param, aux, grad and the three
// state tensors (0 where absent), then each state tensor's format (StateCodec, ipex_train/state_codec.h).
using SlotArg = std::tuple<int, int64_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                           std::array<int, 3>>;

struct Slot {
  Layout layout;
  Chunk chunk;
  // 0: fp32 state, the per-element kernels. Else reduced-byte state, the _staged kernels with this many elements
  // per work-item (steps.cpp's staged(): 1 when all of it is bf16, kQ8Block with int8 state).
  int stage = 0;
};

// The three kernel bundles, compiled on first use: fp32 state, float64, reduced-byte state.
enum Bundle : int { kFloat = 0, kDouble = 1, kStaged = 2 };

bool is_q8(StateCodec c) { return c == StateCodec::kQ8Signed || c == StateCodec::kQ8Unsigned; }
int64_t q8_blocks(int64_t n) { return (n + kQ8Block - 1) / kQ8Block; }

struct ElemSizes {
  size_t param, aux, grad, state;
};

ElemSizes elem_sizes(Layout l) {
  switch (l) {
    case Layout::kF32: return {4, 0, 4, 4};
    case Layout::kF64: return {8, 0, 8, 8};
    case Layout::kSplitBF16: return {2, 2, 2, 4};
    case Layout::kBF16Master:
    case Layout::kF16Master: return {2, 4, 2, 4};
  }
  return {0, 0, 0, 0};
}

bool is_f64(Layout l) { return l == Layout::kF64; }

Bundle bundle_of(const Slot& s) { return is_f64(s.layout) ? kDouble : s.stage != 0 ? kStaged : kFloat; }

// Work-items of a launch over slot s: one per element, or one per stage of reduced-byte state.
int64_t items(const Slot& s) { return s.stage == 0 ? s.chunk.n : (s.chunk.n + s.stage - 1) / s.stage; }

// The kernel `base` (itx::<name> or itx::<name>_norms) for slot s with template arguments `args`.
std::string kernel_name(const Slot& s, const std::string& base, const std::string& args) {
  if (s.stage == 0) return base + "<" + args + ">";
  return base + "_staged<" + args + ", " + std::to_string(s.stage) + ">";
}

std::string where(const char* arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

const char* usm_kind_name(sycl::usm::alloc a) {
  switch (a) {
    case sycl::usm::alloc::host: return "host";
    case sycl::usm::alloc::device: return "device";
    case sycl::usm::alloc::shared: return "shared";
    default: return "unknown";
  }
}

class Runtime {
 public:
  Runtime(sycl::queue q, std::string source, std::vector<std::pair<std::string, std::string>> includes)
      : q_(std::move(q)), source_(std::move(source)), includes_(std::move(includes)) {
    sycl::device dev = q_.get_device();  // ext_oneapi_can_compile is not const
    if (!dev.ext_oneapi_can_compile(syclex::source_language::sycl))
      throw std::runtime_error("the SYCL device '" + dev.get_info<sycl::info::device::name>() +
                               "' cannot compile SYCL source at run time (SYCL-RTC); kernels_xpu needs it");
    group_ = std::min(kGroup, dev.get_info<sycl::info::device::max_work_group_size>());
  }

  // Drops the compiled kernels, bundles and scratch memory. Must run before the process tears down its statics:
  // a sycl::kernel destroyed after the SYCL runtime's own teardown crashes the process at exit.
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    kernels_.clear();
    for (auto& b : bundles_) b.reset();
    if (scratch_ != nullptr) sycl::free(scratch_, q_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    released_ = true;
  }

  ~Runtime() {
    if (!released_) release();
  }

  std::string pointer_type(uintptr_t p) const {
    return usm_kind_name(sycl::get_pointer_type(reinterpret_cast<const void*>(p), q_.get_context()));
  }

  int kernel_count() const { return int(kernels_.size()); }

  std::string device_name() const { return q_.get_device().get_info<sycl::info::device::name>(); }

  // The step of optimizer Opt (a fused:: entry, optimizers.h) named `name`: `rest` holds, as ipex_train.xpu passes
  // them, the fresh_buffers flags (kFreshFlags), the step counts (kCountsSteps), then the scalars of the op's schema.
  template <class Opt>
  void step(const std::string& name, const std::string& schema, const std::vector<SlotArg>& args,
            const py::args& rest) {
    using Coef = typename Opt::template Coef<double>;
    const std::string op = "ipex_train.xpu " + name + "_step";
    size_t k = 0;
    std::vector<bool> fresh;
    std::vector<double> steps;
    if constexpr (Opt::kFreshFlags) fresh = rest[k++].cast<std::vector<bool>>();
    if constexpr (Opt::kCountsSteps) steps = rest[k++].cast<std::vector<double>>();
    // The scalars, then state_key (the ops' last argument: the stochastic-rounding key of this call).
    const size_t n_rest = k + step_args::field_count<typename Opt::Args>() + 1;
    if (rest.size() != n_rest)
      throw py::type_error(op + ": expected " + std::to_string(n_rest) + " arguments after the slots, got " +
                           std::to_string(rest.size()));
    const uint64_t state_key = uint64_t(rest[n_rest - 1].cast<int64_t>());
    const auto a = step_args::scalars<typename Opt::Args>(
        [&](size_t j, auto type) { return rest[k + j].template cast<decltype(type)>(); });
    if (const char* error = step_args::error<Opt>(a)) throw py::value_error(op + ": " + error);
    const int n_states = step_args::states<Opt>(a);
    const std::vector<std::string> names = step_args::state_names(schema);
    auto slots =
        prepare(op.c_str(), args, std::vector<std::string>(names.begin(), names.begin() + n_states), state_key);
    if (Opt::kFreshFlags && n_states > 0 && fresh.size() != slots.size())
      throw py::value_error(op + ": got " + std::to_string(slots.size()) + " params but " +
                            std::to_string(fresh.size()) + " fresh_buffers flags");
    if (Opt::kCountsSteps) check_steps(op.c_str(), slots, steps);
    py::gil_scoped_release nogil;
    std::vector<Coef> coef(slots.size());
    for (size_t i = 0; i < slots.size(); ++i)
      coef[i] = a.coef({Opt::kCountsSteps ? steps[i] : 0.0, Opt::kFreshFlags && n_states > 0 && fresh[i]});
    if constexpr (Opt::kTwoPass) {
      const auto norms = two_pass_norms(slots, "itx::" + name + "_norms", [&](size_t i, const sycl::kernel& kn,
                                                                             void* part) {
        if (is_f64(slots[i].layout))
          launch(kn, items(slots[i]), slots[i].chunk, coef[i], static_cast<double*>(part));
        else
          launch(kn, items(slots[i]), slots[i].chunk, updates::cast<float>(coef[i]), static_cast<float*>(part));
      });
      for (size_t i = 0; i < slots.size(); ++i) a.finish(coef[i], norms[i].first, norms[i].second);
    }
    const std::string variant = ", " + std::to_string(step_args::variant<Opt>(a));
    for (size_t i = 0; i < slots.size(); ++i)
      launch_coef(slots[i], kernel_name(slots[i], "itx::" + name, layout_arg(slots[i]) + variant), coef[i]);
    q_.wait_and_throw();
  }

  void split_bf16(uintptr_t src, uintptr_t top, uintptr_t residual, int64_t n) {
    const char* op = "ipex_train.xpu split_bf16";
    check_usm(op, src, size_t(n) * 4, "src");
    check_usm(op, top, size_t(n) * 2, "top");
    check_usm(op, residual, size_t(n) * 2, "residual");
    py::gil_scoped_release nogil;
    if (n > 0)
      launch(kernel("itx::split_bf16", kFloat), n, reinterpret_cast<const float*>(src),
             reinterpret_cast<uint16_t*>(top), reinterpret_cast<int16_t*>(residual), uint64_t(n));
    q_.wait_and_throw();
  }

  void combine_bf16(uintptr_t top, uintptr_t residual, uintptr_t dst, int64_t n) {
    const char* op = "ipex_train.xpu combine_bf16";
    check_usm(op, top, size_t(n) * 2, "top");
    check_usm(op, residual, size_t(n) * 2, "residual");
    check_usm(op, dst, size_t(n) * 4, "dst");
    py::gil_scoped_release nogil;
    if (n > 0)
      launch(kernel("itx::combine_bf16", kFloat), n, reinterpret_cast<const uint16_t*>(top),
             reinterpret_cast<const int16_t*>(residual), reinterpret_cast<float*>(dst), uint64_t(n));
    q_.wait_and_throw();
  }

 private:
  // Raises naming the argument unless [p, p + bytes) starts and ends in USM memory of this queue's context. A plain
  // malloc'd pointer would happen to work on the CPU device but is undefined behaviour and fails on a GPU.
  void check_usm(const char* op, uintptr_t p, size_t bytes, const std::string& name) const {
    if (bytes == 0) return;
    const sycl::context ctx = q_.get_context();
    const auto first = sycl::get_pointer_type(reinterpret_cast<const void*>(p), ctx);
    const auto last = sycl::get_pointer_type(reinterpret_cast<const void*>(p + bytes - 1), ctx);
    if (p == 0 || first == sycl::usm::alloc::unknown || last == sycl::usm::alloc::unknown)
      throw py::value_error(std::string(op) + ": " + name +
                            " is not in SYCL USM memory of the queue's context; allocate parameters, grads and "
                            "optimizer state with ipex_train.xpu.usm_tensor / to_usm / usm_grads on the same queue");
  }

  std::vector<Slot> prepare(const char* op, const std::vector<SlotArg>& args,
                            const std::vector<std::string>& state_names, uint64_t state_key) const {
    if (released_) throw std::runtime_error(std::string(op) + ": this SYCL runtime was released");
    const bool has_fp64 = q_.get_device().has(sycl::aspect::fp64);
    std::vector<Slot> slots(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      const auto& [layout, n, param, aux, grad, s0, s1, s2, codecs] = args[i];
      if (layout < 0 || layout > int(Layout::kF16Master))
        throw py::value_error(std::string(op) + ": " + where("params", i) + " has unknown layout " +
                              std::to_string(layout));
      Slot& s = slots[i];
      s.layout = Layout(layout);
      if (is_f64(s.layout) && !has_fp64)
        throw py::type_error(std::string(op) + ": " + where("params", i) + " is float64 but the SYCL device '" +
                             device_name() + "' has no fp64 support");
      s.chunk = {reinterpret_cast<void*>(param), reinterpret_cast<void*>(aux), reinterpret_cast<const void*>(grad),
                 {reinterpret_cast<void*>(s0), reinterpret_cast<void*>(s1), reinterpret_cast<void*>(s2)}, n};
      const ElemSizes es = elem_sizes(s.layout);
      check_usm(op, param, es.param * size_t(n), where("params", i));
      if (es.aux != 0) check_usm(op, aux, es.aux * size_t(n), where("aux", i));
      check_usm(op, grad, es.grad * size_t(n), where("grads", i));
      const uintptr_t st[3] = {s0, s1, s2};
      for (size_t k = 0; k < state_names.size(); ++k) {
        const std::string sname = where(state_names[k].c_str(), i);
        const int c = codecs[k];
        if (c < 0 || c > int(StateCodec::kQ8Unsigned))
          throw py::value_error(std::string(op) + ": " + sname + " has unknown state format " + std::to_string(c));
        const StateCodec f = StateCodec(c);
        if (f != StateCodec::kPlain && is_f64(s.layout))
          throw py::type_error(std::string(op) + ": " + sname + " is reduced-byte state of a float64 parameter, "
                               "which keeps float64 state");
        if ((f == StateCodec::kPlain) != (StateCodec(codecs[0]) == StateCodec::kPlain))
          throw py::value_error(std::string(op) + ": " + sname + " and " + where(state_names[0].c_str(), i) +
                                " mix fp32 and reduced-byte state");
        s.chunk.codec[k] = f;
        if (f == StateCodec::kPlain) {
          check_usm(op, st[k], es.state * size_t(n), sname);
          continue;
        }
        if (f == StateCodec::kBF16) {
          check_usm(op, st[k], 2 * size_t(n), sname);
        } else {  // packed int8: the block scales, then the codes
          check_usm(op, st[k], size_t(4 * q8_blocks(n) + n), sname);
          s.chunk.scales[k] = reinterpret_cast<float*>(st[k]);
          s.chunk.state[k] = reinterpret_cast<void*>(st[k] + 4 * size_t(q8_blocks(n)));
        }
        s.stage = std::max(s.stage, is_q8(f) ? int(kQ8Block) : 1);
      }
      s.chunk.key = codec::param_key(state_key, uint64_t(i));
    }
    return slots;
  }

  static void check_steps(const char* op, const std::vector<Slot>& slots, const std::vector<double>& steps) {
    if (steps.size() != slots.size())
      throw py::value_error(std::string(op) + ": got " + std::to_string(slots.size()) + " params but " +
                            std::to_string(steps.size()) + " state_steps");
    for (size_t i = 0; i < steps.size(); ++i)
      if (!(steps[i] >= 1))
        throw py::value_error(std::string(op) + ": " + where("state_steps", i) + " is " + std::to_string(steps[i]) +
                              "; increment the step before calling the kernel");
  }

  static std::string layout_arg(const Slot& s) { return std::to_string(int(s.layout)); }

  // The kernel `name` from bundle b, compiling that bundle on first use.
  const sycl::kernel& kernel(const std::string& name, Bundle b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) throw std::runtime_error("ipex_train.xpu: this SYCL runtime was released");
    auto it = kernels_.find(name);
    if (it != kernels_.end()) return it->second;
    auto& bundle = bundles_[b];
    if (!bundle) bundle = build(b);
    return kernels_.emplace(name, bundle->ext_oneapi_get_kernel(name)).first->second;
  }

  // Every kernel instantiation of bundle b, named as registered_names wants them. The reduced-state kernels are a
  // bundle of their own, so that runs without reduced-byte state never wait for their compilation.
  static std::vector<std::string> kernel_names(Bundle b) {
    std::vector<std::string> names;
    const std::vector<int> layouts = b == kDouble ? std::vector<int>{int(Layout::kF64)}
                                                  : std::vector<int>{int(Layout::kF32), int(Layout::kSplitBF16),
                                                                     int(Layout::kBF16Master), int(Layout::kF16Master)};
    const std::vector<std::string> stages =
        b == kStaged ? std::vector<std::string>{", 1>", ", " + std::to_string(kQ8Block) + ">"}
                     : std::vector<std::string>{">"};
    const std::string suffix = b == kStaged ? "_staged<" : "<";
    for (int l : layouts) {
      const std::string a = std::to_string(l);
      for (const std::string& stage : stages) {
#define ITX_NAMES(name, args)                                                                          \
  for (int v = 0; v < fused::name::kVariants; ++v)                                                     \
    names.push_back("itx::" #name + suffix + a + ", " + std::to_string(v) + stage);                    \
  if (fused::name::kTwoPass) names.push_back("itx::" #name "_norms" + suffix + a + stage);
        ITR_OPTIMIZERS(ITX_NAMES)
#undef ITX_NAMES
      }
    }
    if (b == kFloat) {
      names.push_back("itx::split_bf16");
      names.push_back("itx::combine_bf16");
    }
    return names;
  }

  sycl::kernel_bundle<sycl::bundle_state::executable> build(Bundle b) {
    syclex::include_files inc;
    for (const auto& [name, text] : includes_) inc.add(name, text);
    const bool f64 = b == kDouble;
    const std::string src = std::string("#define ITX_REAL ") + (f64 ? "double" : "float") + "\n" + source_;
    std::string log;
    try {
      auto source = syclex::create_kernel_bundle_from_source(q_.get_context(), syclex::source_language::sycl, src,
                                                             syclex::properties{inc});
      return syclex::build(source, std::vector<sycl::device>{q_.get_device()},
                           syclex::properties{syclex::registered_names{kernel_names(b)}, syclex::save_log{&log},
                                              syclex::build_options{kBuildOptions}});
    } catch (const sycl::exception& e) {
      const char* what = b == kDouble ? "double" : b == kStaged ? "reduced-byte state" : "float";
      throw std::runtime_error(std::string("SYCL-RTC could not compile kernels_xpu/rtc/steps.cpp (") + what +
                               ") for '" + device_name() + "': " + e.what() + "\n" + log);
    }
  }

  size_t group_size(const sycl::kernel& k) const {
    const size_t kmax = k.get_info<sycl::info::kernel_device_specific::work_group_size>(q_.get_device());
    return std::min(group_, kmax);
  }

  size_t groups(const sycl::kernel& k, int64_t n) const {
    const size_t g = group_size(k);
    return (size_t(n) + g - 1) / g;
  }

  // Launches kernel k over n work-items (rounded up to whole work-groups).
  template <class... Args>
  void launch(const sycl::kernel& k, int64_t n, Args... args) {
    const size_t g = group_size(k);
    const size_t global = ((size_t(n) + g - 1) / g) * g;
    q_.submit([&](sycl::handler& h) {
      h.set_args(args...);
      h.parallel_for(sycl::nd_range<1>{sycl::range<1>{global}, sycl::range<1>{g}}, k);
    });
  }

  // Launches kernel `name` over slot s (nothing for an empty one), with the coefficients cast to its element type.
  template <class Coef>
  void launch_coef(const Slot& s, const std::string& name, const Coef& c) {
    if (s.chunk.n == 0) return;
    const sycl::kernel& k = kernel(name, bundle_of(s));
    if (is_f64(s.layout))
      launch(k, items(s), s.chunk, c);
    else
      launch(k, items(s), s.chunk, updates::cast<float>(c));
  }

  // First pass of a two-pass optimizer: run(i, kernel, partial) launches kernel `base<layout>` (or its staged form)
  // for slot i, which writes two sums of squares per work-group into partial. Returns per slot the two norms, the
  // partials added in double in work-group order (deterministic for a given device and size).
  template <class Run>
  std::vector<std::pair<double, double>> two_pass_norms(const std::vector<Slot>& slots, const std::string& base,
                                                        const Run& run) {
    std::vector<const sycl::kernel*> ks(slots.size(), nullptr);
    std::vector<size_t> offset(slots.size() + 1, 0);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].chunk.n > 0) {
        ks[i] = &kernel(kernel_name(slots[i], base, layout_arg(slots[i])), bundle_of(slots[i]));
        offset[i + 1] = offset[i] + 2 * groups(*ks[i], items(slots[i])) * 8;  // bytes, room for double partials
      } else {
        offset[i + 1] = offset[i];
      }
    }
    char* part = static_cast<char*>(scratch(offset.back()));
    for (size_t i = 0; i < slots.size(); ++i)
      if (ks[i] != nullptr) run(i, *ks[i], part + offset[i]);
    q_.wait_and_throw();
    std::vector<std::pair<double, double>> norms(slots.size(), {0.0, 0.0});
    for (size_t i = 0; i < slots.size(); ++i) {
      if (ks[i] == nullptr) continue;
      const size_t count = 2 * groups(*ks[i], items(slots[i]));
      double a = 0, b = 0;
      for (size_t j = 0; j < count; j += 2) {
        if (is_f64(slots[i].layout)) {
          a += reinterpret_cast<const double*>(part + offset[i])[j];
          b += reinterpret_cast<const double*>(part + offset[i])[j + 1];
        } else {
          a += double(reinterpret_cast<const float*>(part + offset[i])[j]);
          b += double(reinterpret_cast<const float*>(part + offset[i])[j + 1]);
        }
      }
      norms[i] = {std::sqrt(a), std::sqrt(b)};
    }
    return norms;
  }

  // Shared USM scratch of at least `bytes`, kept between steps (the host reads the partial sums from it).
  void* scratch(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > scratch_bytes_) {
      if (scratch_ != nullptr) sycl::free(scratch_, q_);
      scratch_ = sycl::malloc_shared(bytes, q_);
      if (scratch_ == nullptr) throw std::runtime_error("ipex_train.xpu: could not allocate USM scratch");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  sycl::queue q_;
  std::string source_;
  std::vector<std::pair<std::string, std::string>> includes_;
  size_t group_ = kGroup;
  std::mutex mu_;
  std::optional<sycl::kernel_bundle<sycl::bundle_state::executable>> bundles_[3];
  std::unordered_map<std::string, sycl::kernel> kernels_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  bool released_ = false;
};

// torch's XPU build hands out its current stream's queue as the address of a sycl::queue.
std::shared_ptr<Runtime> runtime_from_queue_address(uintptr_t address, std::string source,
                                                    std::vector<std::pair<std::string, std::string>> includes) {
  if (address == 0) throw py::value_error("queue_address is 0");
  return std::make_shared<Runtime>(*reinterpret_cast<sycl::queue*>(address), std::move(source), std::move(includes));
}

}  // namespace
}  // namespace xpu
}  // namespace ipex_train

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using ipex_train::xpu::Runtime;
  m.doc() = "kernels_xpu host glue: fused optimizer steps on a SYCL queue (kernels compiled at run time)";
  py::class_<Runtime, std::shared_ptr<Runtime>> runtime(m, "Runtime");
  runtime
      .def(py::init<sycl::queue, std::string, std::vector<std::pair<std::string, std::string>>>(), py::arg("queue"),
           py::arg("source"), py::arg("includes"))
      .def_static("from_queue_address", &ipex_train::xpu::runtime_from_queue_address, py::arg("queue_address"),
                  py::arg("source"), py::arg("includes"))
      .def("release", &Runtime::release)
      .def("pointer_type", &Runtime::pointer_type, py::arg("address"))
      .def("kernel_count", &Runtime::kernel_count)
      .def("device_name", &Runtime::device_name)
      .def("split_bf16", &Runtime::split_bf16)
      .def("combine_bf16", &Runtime::combine_bf16);
#define ITX_BIND(name, schema)                                                                           \
  runtime.def(#name, [](Runtime& r, const std::vector<ipex_train::xpu::SlotArg>& slots, const py::args& rest) { \
    r.step<ipex_train::fused::name>(#name, schema, slots, rest);                                              \
  });
  ITR_OPTIMIZERS(ITX_BIND)
#undef ITX_BIND
}
