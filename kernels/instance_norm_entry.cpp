// PyTorch face of the kernels in instance_norm.h, in four layers, each with one job:
//
//   1. instance_norm(...): the front that Python calls (directly in eager mode, a
//      METH_FASTCALL function; as the op instance_norm_cuda::instance_norm under
//      torch.compile). It holds the one validation of user arguments, sends CPU and
//      float64 inputs to PyTorch's own op, and otherwise runs the ops below: through
//      the dispatcher, or in eager calls on plain CUDA tensors by calling their
//      kernels itself (direct_route).
//   2. Autograd kernels (DispatchKey Autograd): the forward op's backward node, and
//      torch::autograd::Function subclasses around the other ops, serving eager mode
//      and torch.compile alike.
//   3. CUDA kernels of the ops: allocate outputs and workspace, launch on the
//      current stream of the input's device.
//   4. A test interface (pybind11, not ops) that forces kernel paths and queries
//      the path chooser, for tests/, bench.py and check.py.
//
// Fake (meta) kernels of the ops, for torch.compile, are registered from solution.py.
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "instance_norm.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// (y, stats) of the forward op; (grad_input, grad_parameters) of the backward op.
using TensorPair = std::tuple<at::Tensor, at::Tensor>;
// (grad_input, grad_weight, grad_bias) of the test interface's backward.
using TensorTriple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// ---------------------------------------------------------------------------
// Messages and layouts
// ---------------------------------------------------------------------------

// Numbers in error messages go through text(): on the H200 machine (torch 2.11, this
// extension built by g++ 13) a check that streamed an integer into its message
// crashed the process (SIGSEGV) when it fired, while messages of strings, devices and
// dtypes raise normally (docs/perf-notes.md).
template <typename Number>
std::string text(Number value) {
  return std::to_string(value);
}

std::string text(const c10::SymInt& value) {
  const std::optional<int64_t> concrete = value.maybe_as_int();
  return concrete ? std::to_string(*concrete) : std::string("a symbolic size");
}

std::string sizes_text(const at::Tensor& input) {
  std::string out = "[";
  for (int64_t d = 0; d < input.dim(); ++d) out += (d ? ", " : "") + text(input.sym_size(d));
  return out + "]";
}

// Dims (0, 2, ..., dim - 1, 1): a tensor is channels-last (torch.channels_last,
// channels_last_3d, and the same order in 1d) when its permute by these is contiguous.
std::vector<int64_t> channels_last_order(int64_t dim) {
  std::vector<int64_t> order{0};
  for (int64_t d = 2; d < dim; ++d) order.push_back(d);
  order.push_back(1);
  return order;
}

// Whether `t` is dense in the channels-last order (0, 2, ..., dim - 1, 1): its
// permute by that order is contiguous. 4d and 5d tensors answer from the flags
// TensorImpl keeps (torch.channels_last, channels_last_3d); a permuted view costs a
// dispatcher call, so only the other ranks take one.
bool is_channels_last(const at::Tensor& t) {
  switch (t.dim()) {
    case 4: return t.is_contiguous(at::MemoryFormat::ChannelsLast);
    case 5: return t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
    default: return t.permute(channels_last_order(t.dim())).is_contiguous();
  }
}

// The one rule for the layouts the kernels read in place: contiguous, else
// channels-last. Contiguous wins where both hold (C == 1 or spatial == 1).
std::optional<instance_norm::Layout> native_layout(const at::Tensor& input) {
  if (input.is_contiguous()) return instance_norm::Layout::kContiguous;
  if (is_channels_last(input)) return instance_norm::Layout::kChannelsLast;
  return std::nullopt;
}

// `input` itself in a native layout, else a contiguous copy. Outputs take this
// tensor's layout (dense_like).
at::Tensor readable(const at::Tensor& input) { return native_layout(input) ? input : input.contiguous(); }

// `t` (same shape as `like`) with like's native layout, copying only if needed.
at::Tensor like_layout(const at::Tensor& t, const at::Tensor& like) {
  if (like.is_contiguous()) return t.contiguous();
  if (is_channels_last(t)) return t;
  const std::vector<int64_t> order = channels_last_order(like.dim());
  const at::Tensor permuted = t.permute(order);
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
  return permuted.contiguous().permute(inverse);
}

bool kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

// ---------------------------------------------------------------------------
// 1. The validation of user arguments, and the front
// ---------------------------------------------------------------------------

// weight, bias, running_mean, running_var: None or a floating tensor of C elements
// on the input's device, of at most one dimension (PyTorch's instance_norm takes a
// 0-d one where C = 1 and rejects more dimensions).
void check_channel_tensor(const char* name, const std::optional<at::Tensor>& value, const at::Tensor& input) {
  if (!value.has_value()) return;
  TORCH_CHECK_TYPE(value->is_floating_point(), "instance_norm: ", name, " must be a floating-point tensor, got ",
                   value->scalar_type());
  TORCH_CHECK_VALUE(value->dim() <= 1, "instance_norm: ", name, " must be a 1-D tensor of C = ",
                    text(input.sym_size(1)), " elements, got ", text(value->dim()), " dimensions");
  TORCH_CHECK_VALUE(value->sym_numel() == input.sym_size(1), "instance_norm: ", name, " must have C = ",
                    text(input.sym_size(1)), " elements, got ", text(value->sym_numel()));
  TORCH_CHECK_VALUE(value->device() == input.device(), "instance_norm: ", name, " must be on the input's device ",
                    input.device(), ", got ", value->device());
}

// Every user-facing check of instance_norm, before any work, for every device and
// dtype (so errors can differ from PyTorch's own, which raises RuntimeError or
// NotImplementedError for some). Python checks only that the arguments are tensors.
void check_arguments(const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
                     const std::optional<at::Tensor>& running_var, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, bool use_input_stats) {
  TORCH_CHECK_TYPE(input.is_floating_point(), "instance_norm: input must be a floating-point tensor, got ",
                   input.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 3, "instance_norm: input must have shape (N, C, *spatial), got ",
                    text(input.dim()), " dims");
  check_channel_tensor("running_mean", running_mean, input);
  check_channel_tensor("running_var", running_var, input);
  check_channel_tensor("weight", weight, input);
  check_channel_tensor("bias", bias, input);
  TORCH_CHECK_VALUE(running_mean.has_value() == running_var.has_value(),
                    "instance_norm: running_mean and running_var must be given together (both None, or both tensors "
                    "of C elements)");
  if (use_input_stats) {
    c10::SymInt spatial = 1;
    for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.sym_size(d);
    TORCH_CHECK_VALUE(spatial != 1, "Expected more than 1 spatial element when training, got input size ",
                      sizes_text(input));
  } else {
    TORCH_CHECK_VALUE(running_mean.has_value(),
                      "instance_norm: use_input_stats=False needs running_mean and running_var (got None)");
  }
}

// reflection_pad: empty, or PyTorch's F.pad order for mode="reflect": (left, right)
// of the last dim, then of the one before, 2 values per spatial dim (1 to 3 of
// them), each >= 0 and less than the size of the dim it pads.
void check_reflection_pad(const at::Tensor& input, c10::IntArrayRef pad) {
  if (pad.empty()) return;
  const int64_t spatial_dims = input.dim() - 2;
  TORCH_CHECK_VALUE(spatial_dims <= 3, "instance_norm: reflection_pad needs 1 to 3 spatial dims, got ",
                    text(spatial_dims));
  TORCH_CHECK_VALUE(static_cast<int64_t>(pad.size()) == 2 * spatial_dims, "instance_norm: reflection_pad must have ",
                    text(2 * spatial_dims), " values (2 per spatial dim), got ",
                    text(static_cast<int64_t>(pad.size())));
  for (size_t i = 0; i < pad.size(); ++i) {
    const int64_t dim = input.dim() - 1 - static_cast<int64_t>(i / 2);
    TORCH_CHECK_VALUE(pad[i] >= 0 && input.sym_size(dim) > pad[i], "instance_norm: reflection_pad values must be >= 0 "
                      "and less than the size of the dim they pad, got ", text(pad[i]), " for dim ", text(dim),
                      " of size ", text(input.sym_size(dim)));
  }
}

// The epilogue's arguments as the inner ops take them: the activation's code
// (instance_norm::Activation), LeakyReLU's negative slope, the residual, and the
// reflection pad of the output (empty: none; see check_reflection_pad). The residual
// has the input's shape (added before the pad), or with a pad the padded shape
// (residual_after_pad: added after the pad, without an activation).
struct EpilogueArgs {
  int64_t activation;
  double negative_slope;
  std::optional<at::Tensor> residual;
  std::vector<int64_t> reflection_pad;
};

// Whether the epilogue's residual is added after its reflection pad: it has the
// padded shape, not x's (the front checks that it has one of the two).
bool residual_after_pad(const EpilogueArgs& epilogue, const at::Tensor& x) {
  return epilogue.residual && !epilogue.reflection_pad.empty() && epilogue.residual->sym_sizes() != x.sym_sizes();
}

// The activation names of the front (PyTorch's functional names; "gelu_tanh" is
// F.gelu(approximate="tanh")), indexed by instance_norm::Activation.
constexpr const char* kActivationNames[instance_norm::kNumActivations] = {"none",  "relu", "leaky_relu",
                                                                         "silu", "gelu", "gelu_tanh"};

// The front's checks of a residual: the input's dtype, shape and device; with a
// reflection pad the padded shape instead, which takes no activation (the residual
// is then added after the pad).
void check_residual(const at::Tensor& residual, const at::Tensor& input, int64_t activation,
                    c10::IntArrayRef pad) {
  TORCH_CHECK_TYPE(residual.scalar_type() == input.scalar_type(), "instance_norm: residual must have the input's "
                   "dtype ", input.scalar_type(), ", got ", residual.scalar_type());
  std::vector<c10::SymInt> padded = input.sym_sizes().vec();
  for (size_t i = 0; i < pad.size(); ++i) padded[padded.size() - 1 - i / 2] += pad[i];
  std::string padded_text = "[";
  for (size_t d = 0; d < padded.size(); ++d) padded_text += (d ? ", " : "") + text(padded[d]);
  padded_text += "]";
  const bool padded_shape = !pad.empty() && residual.sym_sizes() != input.sym_sizes() &&
                            residual.sym_sizes() == c10::SymIntArrayRef(padded);
  TORCH_CHECK_VALUE(residual.sym_sizes() == input.sym_sizes() || padded_shape, "instance_norm: residual must have "
                    "the input's shape ", sizes_text(input), pad.empty() ? "" : " or the padded shape " + padded_text,
                    ", got ", sizes_text(residual));
  TORCH_CHECK_VALUE(!padded_shape || activation == 0, "instance_norm: a residual of the padded shape is added after "
                    "the pad and takes no activation, got activation '", kActivationNames[activation], "'");
  TORCH_CHECK_VALUE(residual.device() == input.device(), "instance_norm: residual must be on the input's device ",
                    input.device(), ", got ", residual.device());
}

// Typed handles of the ops, looked up once.
using ForwardSignature = TensorPair(const at::Tensor&, const std::optional<at::Tensor>&,
                                    const std::optional<at::Tensor>&, double, int64_t, double,
                                    const std::optional<at::Tensor>&, c10::IntArrayRef);
using BackwardSignature = TensorTriple(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                                       double, const std::optional<at::Tensor>&, bool, c10::IntArrayRef);
using ForwardEvalSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
                                        int64_t, double, const std::optional<at::Tensor>&);
using UpdateSignature = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             double);

template <typename Signature>
const c10::TypedOperatorHandle<Signature>& typed_op(const char* name) {
  // One handle per signature: each op has its own.
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return op;
}

const auto& forward_op() { return typed_op<ForwardSignature>("instance_norm_cuda::forward"); }
const auto& backward_op() { return typed_op<BackwardSignature>("instance_norm_cuda::backward"); }
const auto& forward_eval_op() { return typed_op<ForwardEvalSignature>("instance_norm_cuda::forward_eval"); }
const auto& update_running_stats_op() { return typed_op<UpdateSignature>("instance_norm_cuda::update_running_stats"); }

TensorPair forward_impl(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, const EpilogueArgs& epilogue,
                        instance_norm::ForwardPath path, bool save_stats);
void attach_backward(const TensorPair& forward_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, const EpilogueArgs& epilogue);

bool any_requires_grad(std::initializer_list<const std::optional<at::Tensor>*> tensors) {
  for (const std::optional<at::Tensor>* t : tensors)
    if (t->has_value() && (*t)->requires_grad()) return true;
  return false;
}

// Whether a forward (or eval forward) on these arguments records a backward: grad
// mode on and one of them requires a gradient.
bool records_backward(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  return at::GradMode::is_enabled() && (input.requires_grad() || any_requires_grad({&weight, &bias, &residual}));
}

// Whether a call of the ops on these tensors, in this thread now, would reach this
// file's Autograd and CUDA kernels with nothing run in between: every tensor a plain
// CUDA tensor (no FakeTensor or other Python subclass, no functorch wrapper) and no
// dispatch mode on (TorchDispatchMode, vmap, functionalization, tracing; autocast
// falls through these ops). The keys are computed as the dispatcher computes them.
// Then the eager front and the backward node call the kernels themselves and save the
// dispatcher's two hops per op (host time, docs/perf-notes.md #135); every other call
// goes through the dispatcher. The answer, when direct: whether the op's Autograd
// kernel would run (false under AutoDispatchBelowAutograd or in inference mode).
std::optional<bool> direct_route(std::initializer_list<const at::Tensor*> tensors,
                                 std::initializer_list<const std::optional<at::Tensor>*> optional_tensors) {
  static const c10::DispatchKeySet kDirect{c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA,
                                           c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCUDA,
                                           c10::DispatchKey::BackendSelect};
  c10::DispatchKeySet keys;
  for (const at::Tensor* t : tensors) keys = keys | t->key_set();
  for (const std::optional<at::Tensor>* t : optional_tensors)
    if (t->has_value()) keys = keys | (*t)->key_set();
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  keys = (keys | local.included_) - local.excluded_;
  if (!kDirect.isSupersetOf(keys)) return std::nullopt;
  return keys.has(c10::DispatchKey::AutogradCUDA);
}

// The activation's code from its front name (None: no activation).
int64_t activation_code(const std::optional<c10::string_view>& activation) {
  if (!activation.has_value()) return 0;
  for (int64_t code = 0; code < instance_norm::kNumActivations; ++code) {
    if (*activation == kActivationNames[code]) return code;
  }
  TORCH_CHECK_VALUE(false, "instance_norm: activation must be None, 'relu', 'leaky_relu', 'silu', 'gelu' or "
                    "'gelu_tanh', got '", std::string(*activation), "'");
  return 0;
}

// The epilogue as PyTorch ops: act(y + residual), for the CPU and float64 fallback.
at::Tensor apply_epilogue_aten(at::Tensor y, const EpilogueArgs& epilogue) {
  if (epilogue.residual) y = y + *epilogue.residual;
  switch (static_cast<instance_norm::Activation>(epilogue.activation)) {
    case instance_norm::Activation::kRelu: return at::relu(y);
    case instance_norm::Activation::kLeakyRelu: return at::leaky_relu(y, epilogue.negative_slope);
    case instance_norm::Activation::kSilu: return at::silu(y);
    case instance_norm::Activation::kGelu: return at::gelu(y);
    case instance_norm::Activation::kGeluTanh: return at::gelu(y, "tanh");
    default: return y;
  }
}

// grad * act'(pre) by PyTorch's own backward ops (the eval-mode backward).
at::Tensor activation_gradient_aten(const at::Tensor& grad, const at::Tensor& pre, const EpilogueArgs& epilogue) {
  switch (static_cast<instance_norm::Activation>(epilogue.activation)) {
    case instance_norm::Activation::kRelu: return at::threshold_backward(grad, pre, 0);
    case instance_norm::Activation::kLeakyRelu:
      return at::leaky_relu_backward(grad, pre, epilogue.negative_slope, false);
    case instance_norm::Activation::kSilu: return at::silu_backward(grad, pre);
    case instance_norm::Activation::kGelu: return at::gelu_backward(grad, pre);
    case instance_norm::Activation::kGeluTanh: return at::gelu_backward(grad, pre, "tanh");
    default: return grad;
  }
}

// y reflection-padded by `pad` (check_reflection_pad; empty: y itself), by PyTorch's op.
at::Tensor reflection_padded(const at::Tensor& y, c10::IntArrayRef pad) {
  return pad.empty() ? y : at::pad(y, pad, "reflect");
}

// The normalized y (x's shape) through the epilogue and the pad by PyTorch's ops:
// act(y + residual) padded, or where the residual has the padded shape, the padded
// y plus the residual (residual_after_pad; no activation then).
at::Tensor epilogue_and_pad_aten(const at::Tensor& y, const EpilogueArgs& epilogue) {
  if (residual_after_pad(epilogue, y)) return reflection_padded(y, epilogue.reflection_pad) + *epilogue.residual;
  return reflection_padded(apply_epilogue_aten(y, epilogue), epilogue.reflection_pad);
}

// The gradient of `input` from `grad`, the gradient of input reflection-padded by
// `pad` (empty: grad itself), by PyTorch's pad backward ops.
at::Tensor reflection_pad_gradient(const at::Tensor& grad, const at::Tensor& input, c10::IntArrayRef pad) {
  switch (pad.size()) {
    case 2: return at::reflection_pad1d_backward(grad, input, pad);
    case 4: return at::reflection_pad2d_backward(grad, input, pad);
    case 6: return at::reflection_pad3d_backward(grad, input, pad);
    default: return grad;
  }
}

// PyTorch's F.instance_norm (input, running_mean, running_var, weight, bias,
// use_input_stats, momentum, eps) on this project's kernels, then the fused
// epilogue act(y + residual) and the reflection pad; see solution.instance_norm
// for the semantics. CUDA float32, float16 and bfloat16 inputs run the kernels (other strides than
// contiguous and channels-last are copied to contiguous first; the residual to the
// input's layout); others run PyTorch's ops. `eager`: called from Python outside
// torch.compile's tracing; where direct_route allows, the forward op's work is done
// here without the dispatcher, and a forward that needs neither a gradient nor the
// running update allocates no statistics.
at::Tensor front(const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
                 const std::optional<at::Tensor>& running_var, const std::optional<at::Tensor>& weight,
                 const std::optional<at::Tensor>& bias, bool use_input_stats, double momentum, double eps,
                 const std::optional<c10::string_view>& activation, double negative_slope,
                 const std::optional<at::Tensor>& residual, c10::IntArrayRef reflection_pad, bool eager) {
  check_arguments(input, running_mean, running_var, weight, bias, use_input_stats);
  EpilogueArgs epilogue{activation_code(activation), negative_slope, residual, reflection_pad.vec()};
  check_reflection_pad(input, reflection_pad);
  if (residual) check_residual(*residual, input, epilogue.activation, reflection_pad);
  if (!input.is_cuda() || !kernel_dtype(input.scalar_type())) {
    return epilogue_and_pad_aten(at::instance_norm(input, weight, bias, running_mean, running_var, use_input_stats,
                                                   momentum, eps, /*cudnn_enabled=*/false),
                                 epilogue);
  }
  TORCH_CHECK(eps >= 0.0, "instance_norm: eps must be >= 0, got ", text(eps));
  // The kernels have no forward-mode derivative: a dual tensor's tangent would be
  // dropped (PyTorch's op, above, has one).
  for (const std::optional<at::Tensor>* t : {&weight, &bias, &residual}) {
    TORCH_CHECK(!(t->has_value() && (*t)->_fw_grad(/*level=*/0).defined()),
                "instance_norm: forward-mode AD is not supported on CUDA float32/float16/bfloat16 inputs");
  }
  TORCH_CHECK(!input._fw_grad(/*level=*/0).defined(),
              "instance_norm: forward-mode AD is not supported on CUDA float32/float16/bfloat16 inputs");
  const at::Tensor x = readable(input);
  const bool after_pad = residual_after_pad(epilogue, input);
  if (residual) epilogue.residual = after_pad ? residual->contiguous() : like_layout(*residual, x);
  const std::optional<at::Tensor>& r = epilogue.residual;
  if (!use_input_stats) {
    const at::Tensor y = forward_eval_op().call(x, *running_mean, *running_var, weight, bias, eps,
                                                epilogue.activation, negative_slope, after_pad ? std::nullopt : r);
    return after_pad ? reflection_padded(y, reflection_pad) + *r : reflection_padded(y, reflection_pad);
  }
  // The ops take the pad (one op and one autograd node for the layer), and a residual
  // added after it; a residual of the input's shape leaves the pad to PyTorch's op
  // after them, whose autograd gives the residual its unpadded gradient.
  const bool op_pads = !r || after_pad;
  if (!op_pads) epilogue.reflection_pad.clear();
  const c10::IntArrayRef op_pad = epilogue.reflection_pad;
  const std::optional<bool> direct = eager ? direct_route({&x}, {&weight, &bias, &r}) : std::nullopt;
  TensorPair out;
  if (direct) {
    // What the forward op's Autograd and CUDA kernels would do, without their
    // dispatch (the CUDA kernel below autograd, as there); the statistics only where
    // the backward or the running update needs them.
    const bool backward = *direct && records_backward(x, weight, bias, r);
    {
      RECORD_FUNCTION("instance_norm_cuda::forward", c10::ArrayRef<const c10::IValue>());
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = forward_impl(x, weight, bias, eps, epilogue, instance_norm::ForwardPath::kAuto,
                         backward || running_mean.has_value());
    }
    if (backward) attach_backward(out, x, weight, bias, epilogue);
  } else {
    out = forward_op().call(x, weight, bias, eps, epilogue.activation, negative_slope, r, op_pad);
  }
  if (running_mean.has_value()) {
    update_running_stats_op().call(*running_mean, *running_var, x, std::get<1>(out), momentum, eps);
  }
  return op_pads ? std::get<0>(out) : reflection_padded(std::get<0>(out), reflection_pad);
}

// The op instance_norm_cuda::instance_norm, registered as CompositeImplicitAutograd:
// torch.compile and torch.export trace through it to the ops it calls.
at::Tensor instance_norm_op(const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, bool use_input_stats, double momentum, double eps,
                            std::optional<c10::string_view> activation, double negative_slope,
                            const std::optional<at::Tensor>& residual, at::OptionalIntArrayRef reflection_pad) {
  return front(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, activation,
               negative_slope, residual, reflection_pad.value_or(c10::IntArrayRef()), false);
}

// The op instance_norm_cuda::zero_gradient: contiguous zeros of like's shape, dtype and
// device, the exact gradient of a convolution bias that the compile fusion dropped
// before a norm (solution.py, _DroppedBias). An op of its own, not aten's zeros, so
// that inductor's post-grad hook finds these calls, and only these, to fill them as
// one buffer (solution.py, _merge_zero_gradients). CompositeExplicitAutograd: any
// device, meta included; the result does not depend on like's values.
at::Tensor zero_gradient_op(const at::Tensor& like) { return at::zeros(like.sizes(), like.options()); }

// A Python argument of the eager front: None or a tensor (TypeError naming `name`
// otherwise); a float (or anything with __float__; its own TypeError otherwise).
std::optional<at::Tensor> optional_tensor(PyObject* value, const char* name) {
  if (value == Py_None) return std::nullopt;
  TORCH_CHECK_TYPE(THPVariable_Check(value), "instance_norm: ", name, " must be a torch.Tensor or None, got ",
                   Py_TYPE(value)->tp_name);
  return THPVariable_Unpack(value);
}

double float_argument(PyObject* value) {
  const double number = PyFloat_AsDouble(value);
  if (number == -1.0 && PyErr_Occurred()) throw python_error();
  return number;
}

// None (empty) or a tuple or list of ints (TypeError naming `name` otherwise).
std::vector<int64_t> int_list_argument(PyObject* value, const char* name) {
  std::vector<int64_t> values;
  if (value == Py_None) return values;
  TORCH_CHECK_TYPE(PyTuple_Check(value) || PyList_Check(value), "instance_norm: ", name,
                   " must be None or a tuple of ints, got ", Py_TYPE(value)->tp_name);
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(value);
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(value, i);
    TORCH_CHECK_TYPE(PyLong_Check(item) && !PyBool_Check(item), "instance_norm: ", name,
                     " must be None or a tuple of ints, got an item of type ", Py_TYPE(item)->tp_name);
    const long long number = PyLong_AsLongLong(item);
    if (number == -1 && PyErr_Occurred()) throw python_error();
    values.push_back(number);
  }
  return values;
}

// What eager Python calls: instance_norm(input, running_mean, running_var, weight,
// bias, use_input_stats, momentum, eps, activation, negative_slope, residual,
// reflection_pad), all twelve positional, one call for the whole layer. A
// METH_FASTCALL function, as PyTorch binds its own ops, not a pybind11 one: after
// the launch, pybind11's conversion of eleven arguments was the largest piece of
// the front's host time (docs/perf-notes.md #124). Errors reach Python as they did through pybind11
// (HANDLE_TH_ERRORS: c10's TypeError and ValueError as Python's, other c10 errors as
// RuntimeError; TORCH_WARN as a Python warning).
PyObject* instance_norm_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 12, "instance_norm: the extension's front takes 12 positional arguments, got ",
                   text(static_cast<int64_t>(nargs)));
  TORCH_CHECK_TYPE(THPVariable_Check(args[0]), "instance_norm: input must be a torch.Tensor, got ",
                   Py_TYPE(args[0])->tp_name);
  const int use_input_stats = PyObject_IsTrue(args[5]);
  if (use_input_stats < 0) throw python_error();
  std::optional<c10::string_view> activation;
  if (args[8] != Py_None) {
    TORCH_CHECK_TYPE(PyUnicode_Check(args[8]), "instance_norm: activation must be None or a str, got ",
                     Py_TYPE(args[8])->tp_name);
    Py_ssize_t size = 0;
    const char* name = PyUnicode_AsUTF8AndSize(args[8], &size);
    if (name == nullptr) throw python_error();
    activation = c10::string_view(name, static_cast<size_t>(size));
  }
  return THPVariable_Wrap(front(THPVariable_Unpack(args[0]), optional_tensor(args[1], "running_mean"),
                                optional_tensor(args[2], "running_var"), optional_tensor(args[3], "weight"),
                                optional_tensor(args[4], "bias"), use_input_stats != 0, float_argument(args[6]),
                                float_argument(args[7]), activation, float_argument(args[9]),
                                optional_tensor(args[10], "residual"), int_list_argument(args[11], "reflection_pad"),
                                true));
  END_HANDLE_TH_ERRORS
}

// ---------------------------------------------------------------------------
// 2. Autograd
// ---------------------------------------------------------------------------

// The autograd edges of a Function's inputs: one per tensor argument given, in order
// (an absent optional has none); needs_input_grad takes the edge's index.
struct ParameterEdges {
  int64_t weight, bias, residual;  // -1 when absent

  ParameterEdges(int64_t first, const std::optional<at::Tensor>& weight_arg, const std::optional<at::Tensor>& bias_arg,
                 const std::optional<at::Tensor>& residual_arg)
      : weight(weight_arg ? first : -1),
        bias(bias_arg ? first + (weight_arg ? 1 : 0) : -1),
        residual(residual_arg ? first + (weight_arg ? 1 : 0) + (bias_arg ? 1 : 0) : -1) {}
  ParameterEdges(AutogradContext* ctx)
      : weight(ctx->saved_data["weight_edge"].toInt()),
        bias(ctx->saved_data["bias_edge"].toInt()),
        residual(ctx->saved_data["residual_edge"].toInt()) {}

  void save(AutogradContext* ctx) const {
    ctx->saved_data["weight_edge"] = weight;
    ctx->saved_data["bias_edge"] = bias;
    ctx->saved_data["residual_edge"] = residual;
  }
  static bool needs(AutogradContext* ctx, int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); }
};

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

TensorTriple backward_impl(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const EpilogueArgs& epilogue, instance_norm::BackwardPath path, bool channel_sums);

// The backward op as the backward node calls it: its CUDA kernel itself where the
// dispatcher would go straight there (direct_route, and grad mode off, as the engine
// runs a backward without create_graph), else through the dispatcher. grad_residual
// is undefined or empty where there is none.
TensorTriple run_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                          const EpilogueArgs& epilogue, bool channel_sums) {
  if (!at::GradMode::is_enabled() &&
      direct_route({&grad_output, &input, &stats}, {&weight, &bias, &epilogue.residual})) {
    RECORD_FUNCTION("instance_norm_cuda::backward", c10::ArrayRef<const c10::IValue>());
    return backward_impl(grad_output, input, stats, weight, bias, epilogue, instance_norm::BackwardPath::kAuto,
                         channel_sums);
  }
  return backward_op().call(grad_output, input, stats, weight, bias, epilogue.activation, epilogue.negative_slope,
                            epilogue.residual, channel_sums, epilogue.reflection_pad);
}

// The pointer type of autograd nodes in this torch version: std::shared_ptr<Node>
// (torch 2.11) or c10::intrusive_ptr<Node> (later versions).
using NodePointer = decltype(torch::autograd::Edge::function);

template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePointer, std::shared_ptr<torch::autograd::Node>>) {
    // deleteNode (found through T's base) frees long chains of nodes without recursion.
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>();
  }
}

// The backward node of the forward op, which gives y (stats are saved statistics,
// not differentiable): the gradients of input, weight, bias and residual, its four
// edges in that order (an absent argument's edge is invalid). A Node, as PyTorch's
// generated backward nodes are, rather than a torch::autograd::Function: the
// Function's per-call bookkeeping (its context's map of saved values, the inputs'
// and outputs' metadata) cost more host time than the forward op itself
// (docs/perf-notes.md #107). The backward is not itself differentiable: a double
// backward raises (BackwardFunction). Compiled autograd binds gradients() as a
// function of its graph, as PyTorch's own nodes do. With a reflection pad, y and
// its gradient are padded.
class InstanceNormBackward : public torch::autograd::Node {
 public:
  torch::autograd::SavedVariable input, weight, stats;
  // Saved only with an activation, where the backward recomputes the pre-activation;
  // the residual also where it is added after the pad: its shape tells that its
  // gradient is the padded dy (residual_after_pad).
  torch::autograd::SavedVariable bias, residual;
  int64_t activation = 0;
  double negative_slope = 0.0;
  int64_t bias_dtype = static_cast<int64_t>(at::kFloat);  // of the bias given, for its gradient
  std::vector<int64_t> reflection_pad;

  std::string name() const override { return "InstanceNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return gradients(grads, {input.unpack(), weight.unpack(), stats.unpack(), bias.unpack(), residual.unpack(),
                             activation, negative_slope, bias_dtype, needed_gradients(), reflection_pad});
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable* saved : {&input, &weight, &stats, &bias, &residual}) saved->reset_data();
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    for (const torch::autograd::SavedVariable* saved : {&input, &weight, &stats, &bias, &residual}) {
      args.collect(*saved, false);
    }
    args.collect(activation);
    args.collect(negative_slope);
    args.collect(bias_dtype);
    args.collect(reflection_pad);
  }

  variable_list apply_with_saved(const variable_list& grads, torch::dynamo::autograd::SwapSavedVariables& saved) override {
    for (torch::autograd::SavedVariable* variable : {&input, &weight, &stats, &bias, &residual}) saved.before(*variable);
    const std::vector<c10::IValue> args{input.unpack(), weight.unpack(), stats.unpack(), bias.unpack(),
                                        residual.unpack(), activation, negative_slope, bias_dtype,
                                        needed_gradients(), reflection_pad};
    const auto& compiler = torch::dynamo::autograd::getPyCompilerInterface();
    // Bound once per process, as PyTorch's generated nodes bind theirs: the function
    // namespace is global and refuses a name twice.
    static const std::string function = [&] {
      const at::TypePtr tensor = at::TensorType::get(), integer = at::IntType::get();
      return compiler->bind_function(saved.get_py_compiler(), name(), &functional,
                                     {tensor, tensor, tensor, tensor, tensor, integer, at::FloatType::get(), integer,
                                      integer, at::ListType::ofInts()},
                                     /*is_custom_function=*/false, /*is_traceable=*/true);
    }();
    const c10::IValue output_metadata =
        torch::dynamo::autograd::IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
            torch::dynamo::autograd::get_input_metadata(next_edges()));
    variable_list result =
        compiler->call_function(saved.get_py_compiler(), "apply_functional", function, grads, args, output_metadata);
    for (torch::autograd::SavedVariable* variable : {&input, &weight, &stats, &bias, &residual}) saved.after(*variable);
    return result;
  }

 private:
  // What the gradients are computed from: the saved tensors (undefined where
  // absent), the epilogue, which of the four gradients are needed (bit i for edge
  // i), and the pad.
  struct Saved {
    at::Tensor input, weight, stats, bias, residual;
    int64_t activation;
    double negative_slope;
    int64_t bias_dtype;
    int64_t needed;
    std::vector<int64_t> reflection_pad;

    bool needs(int edge) const { return (needed >> edge) & 1; }
  };

  int64_t needed_gradients() const {
    int64_t needed = 0;
    for (int edge = 0; edge < 4; ++edge) needed |= int64_t{task_should_compute_output(edge)} << edge;
    return needed;
  }

  // The graph compiled autograd builds calls this with args packed as apply_with_saved packs them.
  static variable_list functional(const variable_list& grads, const std::vector<c10::IValue>& args) {
    const auto tensor = [&](size_t i) { return args[i].isTensor() ? args[i].toTensor() : at::Tensor(); };
    return gradients(grads, {tensor(0), tensor(1), tensor(2), tensor(3), tensor(4), args[5].toInt(),
                             args[6].toDouble(), args[7].toInt(), args[8].toInt(), args[9].toIntVector()});
  }

  static variable_list gradients(const variable_list& grads, const Saved& saved) {
    variable_list out(4);
    if (!grads[0].defined()) return out;
    const at::Tensor grad_output = like_layout(grads[0], saved.input);
    // Without a parameter that needs them (none given, or frozen), the kernel skips
    // the per-channel reductions.
    const EpilogueArgs epilogue{saved.activation, saved.negative_slope, defined_or_none(saved.residual),
                                saved.reflection_pad};
    auto [grad_input, grad_parameters, grad_residual] =
        run_backward(grad_output, saved.input, saved.stats, defined_or_none(saved.weight),
                     defined_or_none(saved.bias), epilogue, saved.needs(1) || saved.needs(2));
    if (saved.needs(0)) out[0] = grad_input;
    if (saved.needs(1)) out[1] = grad_parameters[0].to(saved.weight.scalar_type());
    if (saved.needs(2)) out[2] = grad_parameters[1].to(static_cast<at::ScalarType>(saved.bias_dtype));
    // Without an activation the residual's gradient is dy itself: unpadded for one of
    // the input's shape, as it is for one added after the pad.
    if (saved.needs(3) && saved.activation != 0) {
      out[3] = grad_residual;
    } else if (saved.needs(3)) {
      out[3] = residual_after_pad(epilogue, saved.input)
                   ? grad_output
                   : reflection_pad_gradient(grad_output, saved.input, saved.reflection_pad);
    }
    return out;
  }
};

TensorPair forward_autograd(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, int64_t activation,
                            double negative_slope, const std::optional<at::Tensor>& residual,
                            c10::IntArrayRef reflection_pad) {
  TensorPair out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = forward_op().call(input, weight, bias, eps, activation, negative_slope, residual, reflection_pad);
  }
  if (records_backward(input, weight, bias, residual)) {
    attach_backward(out, input, weight, bias, {activation, negative_slope, residual, reflection_pad.vec()});
  }
  return out;
}

// y's (forward_out's first tensor) backward node: saves what InstanceNormBackward
// needs from the forward's arguments and its statistics (forward_out's second).
void attach_backward(const TensorPair& forward_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, const EpilogueArgs& epilogue) {
  auto node = make_node<InstanceNormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias, epilogue.residual));
  node->input = torch::autograd::SavedVariable(input, false);
  node->weight = torch::autograd::SavedVariable(weight, false);
  node->stats = torch::autograd::SavedVariable(std::get<1>(forward_out), false);
  if (epilogue.activation != 0) node->bias = torch::autograd::SavedVariable(bias, false);
  if (epilogue.activation != 0 || residual_after_pad(epilogue, input)) {
    node->residual = torch::autograd::SavedVariable(epilogue.residual, false);
  }
  node->activation = epilogue.activation;
  node->negative_slope = epilogue.negative_slope;
  node->reflection_pad = epilogue.reflection_pad;
  if (bias) node->bias_dtype = static_cast<int64_t>(bias->scalar_type());
  torch::autograd::set_history(std::get<0>(forward_out), node);
}

// Autograd of the backward op: a plain backward (grad mode off, as the engine runs
// it, or nothing that needs a gradient) dispatches straight below autograd; under
// create_graph the outputs get a node whose backward raises.
class BackwardFunction : public torch::autograd::Function<BackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_output, const at::Tensor& input,
                               const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t activation, double negative_slope,
                               const std::optional<at::Tensor>& residual, bool channel_sums,
                               c10::IntArrayRef reflection_pad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_input, grad_parameters, grad_residual] = backward_op().call(
        grad_output, input, stats, weight, bias, activation, negative_slope, residual, channel_sums, reflection_pad);
    return {grad_input, grad_parameters, grad_residual};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(false, "instance_norm: double backward (a derivative of the backward) is not supported");
    return {};
  }
};

TensorTriple backward_autograd(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               int64_t activation, double negative_slope, const std::optional<at::Tensor>& residual,
                               bool channel_sums, c10::IntArrayRef reflection_pad) {
  if (!at::GradMode::is_enabled() || !(grad_output.requires_grad() || input.requires_grad() ||
                                       any_requires_grad({&weight, &bias, &residual}))) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return backward_op().call(grad_output, input, stats, weight, bias, activation, negative_slope, residual,
                              channel_sums, reflection_pad);
  }
  const variable_list out = BackwardFunction::apply(grad_output, input, stats, weight, bias, activation,
                                                    negative_slope, residual, channel_sums, reflection_pad);
  return {out[0], out[1], out[2]};
}

// Autograd of forward_eval. With fixed statistics y = act(pre), pre = xhat * weight[c]
// + bias[c] (+ residual), xhat = (x - running_mean[c]) * rstd[c], rstd = 1 /
// sqrt(running_var[c] + eps): g = grad_output * act'(pre) (PyTorch's own activation
// backward ops), grad_input = g * rstd[c] * weight[c], grad_residual = g; the running
// buffers get no gradient, as in PyTorch.
class EvalFunction : public torch::autograd::Function<EvalFunction> {
 public:
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& running_mean,
                               const at::Tensor& running_var, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps, int64_t activation,
                               double negative_slope, const std::optional<at::Tensor>& residual) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = forward_eval_op().call(input, running_mean, running_var, weight, bias, eps, activation,
                                          negative_slope, residual);
    ctx->save_for_backward({input, running_mean, running_var, weight.value_or(at::Tensor()),
                            bias.value_or(at::Tensor()), residual.value_or(at::Tensor())});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["bias_dtype"] = bias ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1};
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["negative_slope"] = negative_slope;
    ParameterEdges(3, weight, bias, residual).save(ctx);
    return {y};
  }

  // One gradient per forward argument: (input, running_mean, running_var, weight,
  // bias, eps, activation, negative_slope, residual).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &running_mean = saved[1], &running_var = saved[2], &weight = saved[3],
                     &bias = saved[4], &residual = saved[5];
    const ParameterEdges edges(ctx);
    const EpilogueArgs epilogue{ctx->saved_data["activation"].toInt(), ctx->saved_data["negative_slope"].toDouble(),
                                std::nullopt};
    std::vector<int64_t> shape(input.dim(), 1), reduce_dims{0};
    shape[1] = -1;
    for (int64_t d = 2; d < input.dim(); ++d) reduce_dims.push_back(d);
    const at::Tensor rstd = at::rsqrt(running_var.to(at::kFloat) + ctx->saved_data["eps"].toDouble()).view(shape);
    const at::Tensor xhat = (input.to(at::kFloat) - running_mean.to(at::kFloat).view(shape)) * rstd;
    at::Tensor grad = grads[0].to(at::kFloat);
    if (epilogue.activation != 0) {
      at::Tensor pre = weight.defined() ? xhat * weight.to(at::kFloat).view(shape) : xhat;
      if (bias.defined()) pre = pre + bias.to(at::kFloat).view(shape);
      if (residual.defined()) pre = pre + residual.to(at::kFloat);
      grad = activation_gradient_aten(grad, pre, epilogue);
    }
    variable_list out(9);
    if (ctx->needs_input_grad(0)) {
      const at::Tensor scale = weight.defined() ? rstd * weight.to(at::kFloat).view(shape) : rstd;
      out[0] = (grad * scale).to(input.scalar_type());
    }
    if (ParameterEdges::needs(ctx, edges.weight)) out[3] = (grad * xhat).sum(reduce_dims).to(weight.scalar_type());
    if (ParameterEdges::needs(ctx, edges.bias)) {
      out[4] = grad.sum(reduce_dims).to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    }
    if (ParameterEdges::needs(ctx, edges.residual)) out[8] = grad.to(input.scalar_type());
    return out;
  }
};

at::Tensor forward_eval_autograd(const at::Tensor& input, const at::Tensor& running_mean,
                                 const at::Tensor& running_var, const std::optional<at::Tensor>& weight,
                                 const std::optional<at::Tensor>& bias, double eps, int64_t activation,
                                 double negative_slope, const std::optional<at::Tensor>& residual) {
  if (!records_backward(input, weight, bias, residual)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_eval_op().call(input, running_mean, running_var, weight, bias, eps, activation, negative_slope,
                                  residual);
  }
  return EvalFunction::apply(input, running_mean, running_var, weight, bias, eps, activation, negative_slope,
                             residual)[0];
}

// ---------------------------------------------------------------------------
// 3. CUDA kernels of the ops
// ---------------------------------------------------------------------------

instance_norm::DType storage_dtype(const at::Tensor& input) {
  switch (input.scalar_type()) {
    case at::kFloat: return instance_norm::DType::kFloat32;
    case at::kHalf: return instance_norm::DType::kFloat16;
    case at::kBFloat16: return instance_norm::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "input must be float32, float16 or bfloat16, got ", input.scalar_type());
  return instance_norm::DType::kFloat32;  // not reached
}

// The internal invariants of every kernel entry (the ops and the test interface):
// what the launches need to touch only the memory they own. Callers that follow the
// front never fail these; they guard direct calls.
instance_norm::Layout check_kernel_input(const at::Tensor& input) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  storage_dtype(input);
  TORCH_CHECK(input.dim() >= 3, "input must have at least 3 dims (N, C, *spatial), got ", text(input.dim()));
  const std::optional<instance_norm::Layout> layout = native_layout(input);
  TORCH_CHECK(layout.has_value(), "input must be contiguous or channels-last");
  return *layout;
}

// A channel tensor (weight, bias, running statistics) is C values on the input's
// device (an internal invariant: the front checks it for users).
void check_channel(const at::Tensor& value, const char* name, const at::Tensor& input) {
  TORCH_CHECK(value.device() == input.device(), name, " must be on the input's device ", input.device(), ", got ",
              value.device());
  TORCH_CHECK(value.numel() == input.size(1), name, " must have C = ", text(input.size(1)), " elements, got ",
              text(value.numel()));
}

// A tensor, or None, as contiguous float32 (no copy when it is one).
std::optional<at::Tensor> contiguous_float32(const std::optional<at::Tensor>& value) {
  if (!value.has_value()) return std::nullopt;
  // A float32 contiguous tensor as it is: to() and contiguous() would return it too,
  // through a dispatcher call.
  if (value->scalar_type() == at::kFloat && value->is_contiguous()) return *value;
  return value->to(at::kFloat).contiguous();
}

// A channel tensor, or None, as contiguous float32.
std::optional<at::Tensor> channel_float32(const std::optional<at::Tensor>& value, const char* name,
                                          const at::Tensor& input) {
  if (value.has_value()) check_channel(*value, name, input);
  return contiguous_float32(value);
}

// weight and bias (each None or a channel tensor) as the forward kernels read them:
// as they are where those given are contiguous and of one dtype, float32 or the
// input's (parameters of a 16-bit input's dtype need no cast per call), else each as
// contiguous float32. The caller keeps the tensors alive over the launch.
struct ForwardParameters {
  std::optional<at::Tensor> weight, bias;
  instance_norm::DType dtype = instance_norm::DType::kFloat32;

  ForwardParameters(const std::optional<at::Tensor>& weight_in, const std::optional<at::Tensor>& bias_in,
                    const at::Tensor& input) {
    if (weight_in) check_channel(*weight_in, "weight", input);
    if (bias_in) check_channel(*bias_in, "bias", input);
    const std::optional<at::Tensor>& given = weight_in ? weight_in : bias_in;
    const auto as_is = [&](const std::optional<at::Tensor>& value) {
      return !value || (value->scalar_type() == given->scalar_type() && value->is_contiguous());
    };
    const auto kernel_reads = [&](at::ScalarType type) { return type == at::kFloat || type == input.scalar_type(); };
    if (given && kernel_reads(given->scalar_type()) && as_is(weight_in) && as_is(bias_in)) {
      weight = weight_in;
      bias = bias_in;
      dtype = storage_dtype(*given);
    } else {
      weight = contiguous_float32(weight_in);
      bias = contiguous_float32(bias_in);
    }
  }
};

int64_t spatial_size(const at::Tensor& input) {
  int64_t spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.size(d);
  return spatial;
}

instance_norm::ForwardProblem make_problem(const at::Tensor& input, instance_norm::Layout layout,
                                           const ForwardParameters& parameters, double eps) {
  instance_norm::ForwardProblem problem{};
  problem.x = input.data_ptr();
  problem.dtype = storage_dtype(input);
  problem.layout = layout;
  problem.batch = input.size(0);
  problem.num_channels = input.size(1);
  problem.spatial = spatial_size(input);
  problem.weight = parameters.weight ? parameters.weight->data_ptr() : nullptr;
  problem.bias = parameters.bias ? parameters.bias->data_ptr() : nullptr;
  problem.parameter_dtype = parameters.dtype;
  problem.eps = static_cast<float>(eps);
  return problem;
}

instance_norm::ForwardPath checked_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumForwardPaths, "path must be in [0, ",
              text(instance_norm::kNumForwardPaths), "), got ", text(path));
  return static_cast<instance_norm::ForwardPath>(path);
}

// New tensors of the kernels' outputs and buffers, straight from the CUDA caching
// allocator (at::detail::empty_*_cuda, what PyTorch's CUDA empty kernels call): the
// dispatcher's route (at::empty_like, then empty_strided; at::empty) costs host time
// on every call. CUDA graph capture and memory pools see them as any allocation.
// dense_like(x): x's sizes, strides, dtype and device, what at::empty_like gives for
// a dense tensor (contiguous or channels-last, as every kernel input is).
at::Tensor dense_like(const at::Tensor& x) {
  return at::detail::empty_strided_cuda(x.sizes(), x.strides(), x.scalar_type(), x.device());
}

// A new contiguous tensor of `sizes` and `dtype` on `like`'s device.
at::Tensor new_buffer(at::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& like) {
  return at::detail::empty_cuda(sizes, dtype, like.device(), std::nullopt);
}

at::Tensor float_buffer(int64_t size, const at::Tensor& like) { return new_buffer({size}, at::kFloat, like); }

// The current stream of `device`, on which every launch goes (CUDA-graph capture
// included). The device is named, not defaulted: some KernelBench static checkers
// flag any call of a name ending in "Stream" with empty parentheses.
cudaStream_t current_stream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

// A plan's workspace: workspace_bytes of device memory on x's device, or none.
at::Tensor workspace_for(size_t workspace_bytes, const at::Tensor& x) {
  return workspace_bytes > 0 ? new_buffer({static_cast<int64_t>(workspace_bytes)}, at::kByte, x) : at::Tensor();
}

// Runs `problem` (x set) into `output` on `path` (kAuto: the chosen one), padded by
// `pad` where active: plans once, allocates the plan's workspace, launches the plan.
// Fills problem.y and problem.workspace.
void run_forward(const at::Tensor& x, const at::Tensor& output, instance_norm::ForwardProblem& problem,
                 instance_norm::ForwardPath path, const instance_norm::ReflectionPad& pad = {}) {
  problem.y = output.data_ptr();  // before planning: the path may depend on y's alignment
  const instance_norm::ForwardPlan plan = instance_norm::plan_forward(problem, path, pad);
  TORCH_CHECK(plan.valid(), "path ", text(static_cast<int>(path)), " cannot run ", text(problem.num_slices()),
              " slices of ", text(problem.spatial), " ", x.scalar_type(),
              " elements in this layout on this GPU (see kernels/instance_norm.h)");
  const at::Tensor workspace = workspace_for(plan.workspace_bytes, x);
  problem.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  C10_CUDA_CHECK(instance_norm::forward(problem, plan, current_stream(x.device())));
}

// x's sizes with the spatial dims padded by `pad` (its values in F.pad order).
std::vector<int64_t> padded_sizes(const at::Tensor& x, c10::IntArrayRef pad) {
  std::vector<int64_t> sizes = x.sizes().vec();
  for (size_t i = 0; i < pad.size(); ++i) sizes[sizes.size() - 1 - i / 2] += pad[i];
  return sizes;
}

// The kernels' Epilogue from the ops' arguments. The residual must have x's sizes,
// strides, dtype and device, or be added after the pad (residual_after_pad):
// contiguous, of the padded shape, without an activation (the front makes it so;
// an internal invariant of the ops, checked for direct calls). The kernels read it
// in 16-byte vectors: one at another alignment (a view at an odd offset) is copied
// into `aligned`, which the caller keeps alive over the launch. That copy is made here, on real tensors,
// because the front cannot see addresses while torch.compile traces it.
instance_norm::Epilogue kernel_epilogue(const EpilogueArgs& args, const at::Tensor& x, at::Tensor& aligned) {
  TORCH_CHECK(args.activation >= 0 && args.activation < instance_norm::kNumActivations,
              "activation must be in [0, ", text(instance_norm::kNumActivations), "), got ", text(args.activation));
  instance_norm::Epilogue epilogue{};
  epilogue.activation = static_cast<instance_norm::Activation>(args.activation);
  epilogue.negative_slope = static_cast<float>(args.negative_slope);
  if (args.residual) {
    const at::Tensor& r = *args.residual;
    const bool layout = residual_after_pad(args, x)
                            ? r.sizes() == padded_sizes(x, args.reflection_pad) && r.is_contiguous() &&
                                  args.activation == 0
                            : r.sizes() == x.sizes() && r.strides() == x.strides();
    TORCH_CHECK(layout && r.scalar_type() == x.scalar_type() && r.device() == x.device(),
                "residual must have the input's shape, strides, dtype and device, or be contiguous of the padded "
                "shape without an activation");
    aligned = reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0 ? r : r.clone(at::MemoryFormat::Preserve);
    epilogue.residual = aligned.data_ptr();
  }
  return epilogue;
}

// `pad` (checked by check_reflection_pad, or empty) as the kernels take it: 1D and 2D
// inputs; inactive for 3D, whose pad the kernels do not write.
instance_norm::ReflectionPad kernel_pad_of(const at::Tensor& x, c10::IntArrayRef pad) {
  if (pad.empty() || x.dim() > 4) return {};
  const auto value = [&](size_t i) { return static_cast<int>(pad[i]); };
  if (x.dim() == 3) return {1, static_cast<int>(x.size(2)), 0, 0, value(0), value(1)};
  return {static_cast<int>(x.size(2)), static_cast<int>(x.size(3)), value(2), value(3), value(0), value(1)};
}

// The reflection pad the forward kernels write for this call on `path`
// (instance_norm::forward_pads; inactive where they do not: the caller pads y).
// epilogue.reflection_pad is checked (check_reflection_pad) or empty.
instance_norm::ReflectionPad kernel_reflection_pad(const at::Tensor& x, instance_norm::Layout layout,
                                                   const EpilogueArgs& epilogue, instance_norm::ForwardPath path) {
  const instance_norm::ReflectionPad kernel_pad = kernel_pad_of(x, epilogue.reflection_pad);
  if (!kernel_pad.active()) return {};
  const ForwardParameters none(std::nullopt, std::nullopt, x);
  instance_norm::ForwardProblem problem = make_problem(x, layout, none, 0.0);
  // Only whether there is a residual counts, and the activation; one of x's shape is
  // added before the pad, which the kernels do not take.
  if (epilogue.residual && !residual_after_pad(epilogue, x)) return {};
  problem.epilogue.residual = epilogue.residual ? x.data_ptr() : nullptr;
  problem.epilogue.activation = static_cast<instance_norm::Activation>(epilogue.activation);
  return instance_norm::forward_pads(problem, kernel_pad, path) ? kernel_pad : instance_norm::ReflectionPad{};
}

// What every forward launch of `x` needs: its output (allocated before any other
// buffer of the call, so that tests which poison the block a same-sized output will
// take see it land there; padded where the kernels write the pad), weight and bias
// as the kernels read them (kept alive here), and the problem pointing at them. x is
// checked first, before anything is allocated; members are initialized in this
// order. A residual added after the pad (residual_after_pad) is added by the kernels
// where they write the pad, else by result().
struct ForwardCall {
  instance_norm::Layout layout;
  instance_norm::ReflectionPad pad;
  at::Tensor output;
  ForwardParameters parameters;
  at::Tensor residual;  // the epilogue's residual as the kernels read it (see kernel_epilogue)
  instance_norm::ForwardProblem problem;
  std::optional<at::Tensor> residual_after;  // added to the padded output by result()

  ForwardCall(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
              double eps, const EpilogueArgs& epilogue, instance_norm::ForwardPath path)
      : layout(check_kernel_input(x)),
        pad(kernel_reflection_pad(x, layout, epilogue, path)),
        output(pad.active() ? new_buffer(padded_sizes(x, epilogue.reflection_pad), x.scalar_type(), x)
                            : dense_like(x)),
        parameters(weight, bias, x),
        problem(make_problem(x, layout, parameters, eps)) {
    if (residual_after_pad(epilogue, x) && !pad.active()) {
      residual_after = epilogue.residual;
      problem.epilogue = kernel_epilogue({epilogue.activation, epilogue.negative_slope}, x, residual);
    } else {
      problem.epilogue = kernel_epilogue(epilogue, x, residual);
    }
  }

  // The output as the op returns it: padded by PyTorch's op where the kernels did
  // not, then plus a residual added after the pad that they did not add.
  at::Tensor result(const EpilogueArgs& epilogue) const {
    if (pad.active()) return output;
    const at::Tensor padded = reflection_padded(output, epilogue.reflection_pad);  // a new tensor: ours to add to
    return residual_after ? padded.add_(*residual_after) : padded;
  }
};

// input: (N, C, *spatial) CUDA float32/float16/bfloat16, contiguous or channels-last.
// weight, bias: None or C values (any float dtype) on the input's device.
// Returns (y, stats): y of the input's shape, dtype and layout, every (n, c) slice
// normalized, (x - mean) * rstd with rstd = 1 / sqrt(var + eps) (biased var), times
// weight[c] plus bias[c], then the epilogue act(. + residual); stats the slices'
// float32 statistics, (2, N * C): row 0 mean, row 1 rstd, in one tensor because each
// allocation costs host time. Without save_stats, stats is undefined (None) and
// nothing is allocated for it. With epilogue.reflection_pad, y is padded after the
// epilogue (contiguous): by the kernel where forward_pads, else by PyTorch's op.
TensorPair forward_impl(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, const EpilogueArgs& epilogue,
                        instance_norm::ForwardPath path, bool save_stats) {
  const c10::cuda::CUDAGuard device_guard(x.device());  // CUDA tensors only reach here
  ForwardCall call(x, weight, bias, eps, epilogue, path);
  at::Tensor stats;
  if (save_stats) {
    stats = new_buffer({2, call.problem.num_slices()}, at::kFloat, x);
    call.problem.mean = stats.data_ptr<float>();
    call.problem.rstd = call.problem.mean + call.problem.num_slices();
  }
  run_forward(x, call.output, call.problem, path, call.pad);
  return {call.result(epilogue), stats};
}

TensorPair forward_cuda(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, int64_t activation, double negative_slope,
                        const std::optional<at::Tensor>& residual, c10::IntArrayRef reflection_pad) {
  check_reflection_pad(input, reflection_pad);
  return forward_impl(input, weight, bias, eps, {activation, negative_slope, residual, reflection_pad.vec()},
                      instance_norm::ForwardPath::kAuto, true);
}

// The statistics of `input` (N, C, *spatial) in stats, forward's (2, N * C) float32
// output (row 0 mean, row 1 rstd): the rows' data, checked.
std::pair<const float*, const float*> stats_rows(const at::Tensor& stats, const at::Tensor& input) {
  const int64_t num_slices = input.size(0) * input.size(1);
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 2 && stats.size(0) == 2 &&
                  stats.size(1) == num_slices && stats.is_contiguous() && stats.device() == input.device(),
              "stats must be forward's float32 (2, N * C) output on the input's device");
  const float* mean = stats.data_ptr<float>();
  return {mean, mean + num_slices};
}

// use_input_stats=False: y = (x - running_mean[c]) / sqrt(running_var[c] + eps)
// * weight[c] + bias[c], then the epilogue; one elementwise sweep.
at::Tensor forward_eval_cuda(const at::Tensor& input, const at::Tensor& running_mean, const at::Tensor& running_var,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps, int64_t activation, double negative_slope,
                             const std::optional<at::Tensor>& residual) {
  const c10::cuda::CUDAGuard device_guard(input.device());  // CUDA tensors only reach here
  ForwardCall call(input, weight, bias, eps, {activation, negative_slope, residual}, instance_norm::ForwardPath::kAuto);
  const std::optional<at::Tensor> mean_f32 = channel_float32(running_mean, "running_mean", input);
  const std::optional<at::Tensor> var_f32 = channel_float32(running_var, "running_var", input);
  call.problem.running_mean = mean_f32->data_ptr<float>();
  call.problem.running_var = var_f32->data_ptr<float>();
  run_forward(input, call.output, call.problem, instance_norm::ForwardPath::kAuto);
  return call.output;
}

// PyTorch's running-statistics update (kernels/instance_norm.h, update_running_stats)
// from forward's stats of `input` (whose sizes give N and the spatial size), in place
// on running_mean and running_var (C values of any float dtype; through a float32
// copy when they are not float32).
void update_running_stats_cuda(const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& input,
                               const at::Tensor& stats, double momentum, double eps) {
  check_kernel_input(input);
  const int64_t spatial = spatial_size(input);
  const auto [mean, rstd] = stats_rows(stats, input);
  TORCH_CHECK(spatial > 1, "the running variance needs more than 1 spatial element, got ", text(spatial));
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor mean_f32 = *channel_float32(running_mean, "running_mean", input);
  at::Tensor var_f32 = *channel_float32(running_var, "running_var", input);
  C10_CUDA_CHECK(instance_norm::update_running_stats(
      mean_f32.data_ptr<float>(), var_f32.data_ptr<float>(), mean, rstd, input.size(0), input.size(1), spatial,
      static_cast<float>(momentum), static_cast<float>(eps), current_stream(input.device())));
  if (!mean_f32.is_same(running_mean)) running_mean.copy_(mean_f32);
  if (!var_f32.is_same(running_var)) running_var.copy_(var_f32);
}

// The backward problem of grad_output (with an active pad: the gradient of the
// padded y, contiguous) and input, without the statistics and buffers.
instance_norm::BackwardProblem make_backward_problem(const at::Tensor& grad_output, const at::Tensor& input,
                                                     instance_norm::Layout layout,
                                                     const std::optional<at::Tensor>& weight_f32,
                                                     const instance_norm::ReflectionPad& pad) {
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type() && grad_output.device() == input.device() &&
                  (pad.active() ? grad_output.is_contiguous() &&
                                      grad_output.numel() == input.size(0) * input.size(1) * pad.padded_spatial()
                                : grad_output.sizes() == input.sizes() && grad_output.strides() == input.strides()),
              "backward: grad_output must have the input's shape, strides, dtype and device");
  instance_norm::BackwardProblem problem{};
  problem.x = input.data_ptr();
  problem.dy = grad_output.data_ptr();
  problem.dtype = storage_dtype(input);
  problem.layout = layout;
  problem.batch = input.size(0);
  problem.num_channels = input.size(1);
  problem.spatial = spatial_size(input);
  problem.weight = weight_f32 ? weight_f32->data_ptr<float>() : nullptr;
  return problem;
}

// The pad the backward kernels read for this call on `path` (instance_norm::
// backward_pads; inactive where they do not: the caller folds the padded gradient
// first). grad_output: the gradient of y padded by epilogue.reflection_pad (checked),
// or of y where that is empty.
instance_norm::ReflectionPad kernel_backward_pad(const at::Tensor& grad_output, const at::Tensor& input,
                                                 instance_norm::Layout layout, const EpilogueArgs& epilogue,
                                                 instance_norm::BackwardPath path) {
  const instance_norm::ReflectionPad pad = kernel_pad_of(input, epilogue.reflection_pad);
  if (!pad.active() || !grad_output.is_contiguous() ||
      grad_output.sizes() != padded_sizes(input, epilogue.reflection_pad)) {
    return {};
  }
  instance_norm::BackwardProblem problem = make_backward_problem(grad_output, input, layout, std::nullopt, pad);
  problem.epilogue.activation = static_cast<instance_norm::Activation>(epilogue.activation);
  problem.epilogue.residual = epilogue.residual ? input.data_ptr() : nullptr;  // only whether there is one counts
  return instance_norm::backward_pads(problem, pad, path) ? pad : instance_norm::ReflectionPad{};
}

instance_norm::BackwardPath checked_backward_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumBackwardPaths, "path must be in [0, ",
              text(instance_norm::kNumBackwardPaths), "), got ", text(path));
  return static_cast<instance_norm::BackwardPath>(path);
}

// Gradient of forward for its input, weight, bias and residual. grad_output and
// input: same shape, strides (contiguous or channels-last), dtype and device; stats:
// forward's (2, N * C) output; weight, bias: None or C values; the epilogue as in the
// forward (bias and residual are read only with an activation). Returns (grad_input
// in the input's dtype and layout, grad_parameters, grad_residual): grad_parameters
// float32 (2, C), row 0 grad_weight and row 1 grad_bias, the sums over n of the
// per-slice sum(g * xhat) and sum(g), g = dy * act'(pre), in a fixed order
// (bit-identical run to run); without channel_sums (no parameter needs them) it is
// (2, 0) and the reduction is skipped. grad_residual is g (the input's dtype and
// layout) with a residual and an activation, else undefined (nothing allocated; the op
// returns an empty tensor): without an activation the residual's gradient is
// grad_output itself. With epilogue.reflection_pad, grad_output is the gradient of
// the padded y (contiguous): read padded by the kernel where backward_pads, else
// folded first by PyTorch's pad backward.
TensorTriple backward_impl(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const EpilogueArgs& epilogue, instance_norm::BackwardPath path, bool channel_sums) {
  const instance_norm::Layout layout = check_kernel_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const instance_norm::ReflectionPad pad = kernel_backward_pad(grad_output, input, layout, epilogue, path);
  const at::Tensor dy = epilogue.reflection_pad.empty() || pad.active()
                            ? grad_output
                            : like_layout(reflection_pad_gradient(grad_output, input, epilogue.reflection_pad), input);
  const auto [mean, rstd] = stats_rows(stats, input);
  at::Tensor grad_input = dense_like(input);
  const bool activation = epilogue.activation != 0;
  const at::Tensor grad_residual = activation && epilogue.residual ? dense_like(input) : at::Tensor();
  const std::optional<at::Tensor> weight_f32 = channel_float32(weight, "weight", input);
  const std::optional<at::Tensor> bias_f32 = activation ? channel_float32(bias, "bias", input) : std::nullopt;
  instance_norm::BackwardProblem problem = make_backward_problem(dy, input, layout, weight_f32, pad);
  problem.mean = mean;
  problem.rstd = rstd;
  at::Tensor residual;  // kept alive over the launch (see kernel_epilogue)
  // A residual added after the pad comes without an activation: nothing here reads it.
  problem.epilogue = residual_after_pad(epilogue, input)
                         ? kernel_epilogue({epilogue.activation, epilogue.negative_slope}, input, residual)
                         : kernel_epilogue(epilogue, input, residual);
  problem.bias = bias_f32 ? bias_f32->data_ptr<float>() : nullptr;
  problem.grad_residual = grad_residual.defined() ? grad_residual.data_ptr() : nullptr;
  problem.dx = grad_input.data_ptr();  // before planning: the path may depend on dx's alignment
  const instance_norm::BackwardPlan plan = instance_norm::plan_backward(problem, path, pad);
  TORCH_CHECK(plan.valid(), "backward path ", text(static_cast<int>(path)),
              " cannot run this input on this GPU (see kernels/instance_norm.h)");
  const at::Tensor workspace = workspace_for(plan.workspace_bytes, input);
  // One allocation (each costs host time): the parameter gradients (2, C) first, at
  // storage offset 0 as the fake kernel's fresh tensor has it (compiled code may
  // address the output through its storage), then the two per-slice sums.
  const int64_t num_slices = input.size(0) * input.size(1);
  const int64_t channels = channel_sums ? input.size(1) : 0;
  const at::Tensor grad_parameters = float_buffer(2 * channels + 2 * num_slices, input);
  float* const grad_weight = grad_parameters.data_ptr<float>();
  problem.sum_dy = grad_weight + 2 * channels;
  problem.sum_dy_xhat = problem.sum_dy + num_slices;
  // The buffer, still ours alone, becomes the (2, C) tensor over its first values in
  // place (a view would cost a dispatcher call); the sums stay in its storage.
  grad_parameters.unsafeGetTensorImpl()->set_sizes_contiguous({2, channels});
  problem.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  const cudaStream_t stream = current_stream(input.device());
  C10_CUDA_CHECK(instance_norm::backward(problem, plan, stream));
  if (channel_sums) {
    C10_CUDA_CHECK(instance_norm::parameter_gradients(grad_weight, grad_weight + channels, problem.sum_dy_xhat,
                                                      problem.sum_dy, input.size(0), channels, stream));
  }
  return {grad_input, grad_parameters, grad_residual};
}

TensorTriple backward_cuda(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           int64_t activation, double negative_slope, const std::optional<at::Tensor>& residual,
                           bool channel_sums, c10::IntArrayRef reflection_pad) {
  check_reflection_pad(input, reflection_pad);
  auto out = backward_impl(grad_output, input, stats, weight, bias,
                           {activation, negative_slope, residual, reflection_pad.vec()},
                           instance_norm::BackwardPath::kAuto, channel_sums);
  // The schema's third output is a tensor: an empty one where there is no residual's gradient.
  if (!std::get<2>(out).defined()) std::get<2>(out) = float_buffer(0, input);
  return out;
}

// ---------------------------------------------------------------------------
// 4. Test interface: forced paths and the chooser's answers
// ---------------------------------------------------------------------------

// The epilogue of a test call: activation by its front name, the residual in the
// input's layout (the ops align it), or contiguous where it has the padded shape.
EpilogueArgs test_epilogue(const at::Tensor& input, const std::optional<std::string>& activation,
                           double negative_slope, const std::optional<at::Tensor>& residual,
                           const std::vector<int64_t>& reflection_pad) {
  const std::optional<c10::string_view> name =
      activation ? std::optional<c10::string_view>(*activation) : std::nullopt;
  check_reflection_pad(input, reflection_pad);
  return {activation_code(name), negative_slope,
          residual ? std::optional<at::Tensor>(residual->sizes() == input.sizes() ? like_layout(*residual, input)
                                                                                  : residual->contiguous())
                   : std::nullopt,
          reflection_pad};
}

TensorPair forward_with_stats(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, int64_t path, bool save_stats,
                              const std::optional<std::string>& activation, double negative_slope,
                              const std::optional<at::Tensor>& residual, const std::vector<int64_t>& reflection_pad) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", text(eps));
  const at::Tensor x = readable(input);
  return forward_impl(x, weight, bias, eps, test_epilogue(x, activation, negative_slope, residual, reflection_pad),
                      checked_path(path), save_stats);
}

at::Tensor forward_test(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, int64_t path,
                        const std::optional<std::string>& activation, double negative_slope,
                        const std::optional<at::Tensor>& residual, const std::vector<int64_t>& reflection_pad) {
  return std::get<0>(forward_with_stats(input, weight, bias, eps, path, false, activation, negative_slope, residual,
                                        reflection_pad));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_test(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& stats,
    const std::optional<at::Tensor>& weight, int64_t path, bool channel_sums, const std::optional<at::Tensor>& bias,
    const std::optional<std::string>& activation, double negative_slope, const std::optional<at::Tensor>& residual,
    const std::vector<int64_t>& reflection_pad) {
  const auto [grad_input, grad_parameters, grad_residual] = backward_impl(
      grad_output, input, stats, weight, bias,
      test_epilogue(input, activation, negative_slope, residual, reflection_pad), checked_backward_path(path),
      channel_sums);
  return {grad_input, grad_parameters[0], grad_parameters[1], grad_residual};
}

// Whether backward(..., path) can run for this input (grad_output laid out alike) on
// its device, with a residual's gradient through an activation (residual_gradient)
// or without.
bool backward_path_supported(const at::Tensor& input, int64_t path, bool residual_gradient) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  const std::optional<instance_norm::Layout> layout = native_layout(input);
  if (path < 0 || path >= instance_norm::kNumBackwardPaths || !layout) return false;
  check_kernel_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  instance_norm::BackwardProblem problem = make_backward_problem(input, input, *layout, std::nullopt, {});
  if (residual_gradient) {
    problem.epilogue.activation = instance_norm::Activation::kRelu;
    problem.epilogue.residual = input.data_ptr();
  }
  return instance_norm::plan_backward(problem, static_cast<instance_norm::BackwardPath>(path)).valid();
}

// The plan of `path` for this input on its device, made before y exists (y counts
// as aligned); none for a path id out of range.
std::optional<instance_norm::ForwardPlan> query_plan(const at::Tensor& input, int64_t path) {
  const at::Tensor x = readable(input);
  const instance_norm::Layout layout = check_kernel_input(x);
  if (path < 0 || path >= instance_norm::kNumForwardPaths) return std::nullopt;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const ForwardParameters none(std::nullopt, std::nullopt, x);
  return instance_norm::plan_forward(make_problem(x, layout, none, 0.0), static_cast<instance_norm::ForwardPath>(path));
}

// The path forward(input, ..., path=0) takes for this input on its device.
int64_t chosen_path(const at::Tensor& input) { return static_cast<int64_t>(query_plan(input, 0)->path); }

// Whether forward(input, ..., path) can run this input on its device.
bool path_supported(const at::Tensor& input, int64_t path) {
  const std::optional<instance_norm::ForwardPlan> plan = query_plan(input, path);
  return plan && plan->valid();
}

// Capacities per dtype name, as torch names the dtypes.
template <typename Capacities, typename Entries>
py::dict capacities_by_dtype(Capacities (*capacities)(instance_norm::DType), Entries entries) {
  py::dict by_dtype;
  for (const auto& [name, dtype] : {std::pair<const char*, instance_norm::DType>{"float32", instance_norm::DType::kFloat32},
                                    {"float16", instance_norm::DType::kFloat16},
                                    {"bfloat16", instance_norm::DType::kBFloat16}}) {
    by_dtype[name] = entries(capacities(dtype));
  }
  return by_dtype;
}

}  // namespace

// The ops. Schemas name mutation (running statistics) so that torch.compile
// functionalizes it.
TORCH_LIBRARY(instance_norm_cuda, m) {
  m.def("instance_norm(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor? weight, "
        "Tensor? bias, bool use_input_stats, float momentum, float eps, str? activation=None, "
        "float negative_slope=0.01, Tensor? residual=None, int[]? reflection_pad=None) -> Tensor");
  m.def("forward(Tensor input, Tensor? weight, Tensor? bias, float eps, int activation, float negative_slope, "
        "Tensor? residual, int[] reflection_pad=[]) -> (Tensor, Tensor)");
  m.def("backward(Tensor grad_output, Tensor input, Tensor stats, Tensor? weight, Tensor? bias, int activation, "
        "float negative_slope, Tensor? residual, bool channel_sums, int[] reflection_pad=[]) -> (Tensor, Tensor, "
        "Tensor)");
  m.def("forward_eval(Tensor input, Tensor running_mean, Tensor running_var, Tensor? weight, Tensor? bias, "
        "float eps, int activation, float negative_slope, Tensor? residual) -> Tensor");
  m.def("update_running_stats(Tensor(a!) running_mean, Tensor(b!) running_var, Tensor input, Tensor stats, "
        "float momentum, float eps) -> ()");
  m.def("zero_gradient(Tensor like) -> Tensor");
}

TORCH_LIBRARY_IMPL(instance_norm_cuda, CompositeImplicitAutograd, m) {
  m.impl("instance_norm", &instance_norm_op);
}

TORCH_LIBRARY_IMPL(instance_norm_cuda, CompositeExplicitAutograd, m) {
  m.impl("zero_gradient", &zero_gradient_op);
}

TORCH_LIBRARY_IMPL(instance_norm_cuda, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("forward_eval", &forward_eval_cuda);
  m.impl("update_running_stats", &update_running_stats_cuda);
}

TORCH_LIBRARY_IMPL(instance_norm_cuda, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("forward_eval", &forward_eval_autograd);
  m.impl("backward", &backward_autograd);
  m.impl("update_running_stats", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(instance_norm_cuda, ADInplaceOrView, m) {
  // Bumps the version counters of the updated buffers.
  m.impl("update_running_stats", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "InstanceNorm CUDA kernels (see kernels/instance_norm.h and kernels/instance_norm_entry.cpp)";
  // Outlives the module, as CPython requires of a method table.
  static PyMethodDef fastcall_methods[] = {
      {"instance_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&instance_norm_eager)),
       METH_FASTCALL,
       "F.instance_norm on the kernels, then the epilogue and the pad: (input, running_mean, running_var, weight, "
       "bias, use_input_stats, momentum, eps, activation, negative_slope, residual, reflection_pad), positional"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), fastcall_methods) != 0) throw py::error_already_set();
  m.def("forward", &forward_test, "forward (y only) on a forced path (0 = automatic)", py::arg("input"),
        py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5, py::arg("path") = 0,
        py::arg("activation") = py::none(), py::arg("negative_slope") = 0.01, py::arg("residual") = py::none(),
        py::arg("reflection_pad") = std::vector<int64_t>());
  m.def("forward_with_stats", &forward_with_stats,
        "forward on a forced path: (y, stats), stats float32 (2, N * C) of the slices' mean (row 0) and rstd (row 1)",
        py::arg("input"), py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5,
        py::arg("path") = 0, py::arg("save_stats") = true, py::arg("activation") = py::none(),
        py::arg("negative_slope") = 0.01, py::arg("residual") = py::none(),
        py::arg("reflection_pad") = std::vector<int64_t>());
  m.def("backward", &backward_test,
        "backward on a forced path: (grad_input, grad_weight, grad_bias, grad_residual); grad_residual is None "
        "without a residual and an activation",
        py::arg("grad_output"),
        py::arg("input"), py::arg("stats"), py::arg("weight") = py::none(), py::arg("path") = 0,
        py::arg("channel_sums") = true, py::arg("bias") = py::none(), py::arg("activation") = py::none(),
        py::arg("negative_slope") = 0.01, py::arg("residual") = py::none(),
        py::arg("reflection_pad") = std::vector<int64_t>());
  m.def("backward_path_supported", &backward_path_supported,
        "Whether backward(..., path) can run this input on its device (residual_gradient: with a residual's "
        "gradient through an activation)",
        py::arg("input"), py::arg("path"), py::arg("residual_gradient") = false);
  m.def("chosen_path", &chosen_path, "ForwardPath that path=0 takes for this input on its device", py::arg("input"));
  m.def("path_supported", &path_supported, "Whether forward(input, ..., path) can run this input on its device",
        py::arg("input"), py::arg("path"));
  // Forced paths are 1 .. num_forward_paths - 1 and 1 .. num_backward_paths - 1 (0: automatic).
  m.attr("num_forward_paths") = instance_norm::kNumForwardPaths;
  m.attr("num_backward_paths") = instance_norm::kNumBackwardPaths;
  // {name: id} of the paths in kernels/instance_norm.h, for tools that take a path by name.
  py::dict forward_paths, backward_paths;
  for (const auto& [name, path] : {std::pair<const char*, instance_norm::ForwardPath>{"auto", instance_norm::ForwardPath::kAuto},
                                   {"block", instance_norm::ForwardPath::kBlock},
                                   {"cluster", instance_norm::ForwardPath::kCluster},
                                   {"warp", instance_norm::ForwardPath::kWarp},
                                   {"split", instance_norm::ForwardPath::kSplit},
                                   {"cooperative", instance_norm::ForwardPath::kCooperative},
                                   {"pipelined", instance_norm::ForwardPath::kPipelined}}) {
    forward_paths[name] = static_cast<int>(path);
  }
  for (const auto& [name, path] : {std::pair<const char*, instance_norm::BackwardPath>{"auto", instance_norm::BackwardPath::kAuto},
                                   {"generic", instance_norm::BackwardPath::kGeneric},
                                   {"cluster", instance_norm::BackwardPath::kCluster},
                                   {"cooperative", instance_norm::BackwardPath::kCooperative},
                                   {"block", instance_norm::BackwardPath::kBlock}}) {
    backward_paths[name] = static_cast<int>(path);
  }
  m.attr("forward_paths") = forward_paths;
  m.attr("backward_paths") = backward_paths;
  // {dtype name: {capacity: values}} of the sizes the paths' limits follow from
  // (ForwardCapacities and BackwardCapacities in kernels/instance_norm.h).
  m.attr("forward_capacities") =
      capacities_by_dtype(&instance_norm::forward_capacities, [](const instance_norm::ForwardCapacities& c) {
        py::dict entries;
        entries["warp_spatial"] = c.warp_spatial;
        entries["resident_cta"] = c.resident_cta;
        entries["max_cluster_size"] = c.max_cluster_size;
        entries["pipelined_cta"] = c.pipelined_cta;
        return entries;
      });
  m.attr("backward_capacities") =
      capacities_by_dtype(&instance_norm::backward_capacities, [](const instance_norm::BackwardCapacities& c) {
        py::dict entries;
        entries["block_spatial"] = c.block_spatial;
        return entries;
      });
  m.def(
      "plans_made",
      [] {
        const instance_norm::PlanCounts counts = instance_norm::plans_made();
        py::dict made;
        made["forward"] = counts.forward;
        made["backward"] = counts.backward;
        return made;
      },
      "Test hook: {'forward': n, 'backward': n}, the plans made in this process (every call of the ops and every "
      "path query plans once)");
  m.def(
      "emulate_device",
      [](int major, int shared_per_cta, int shared_per_sm, int threads_per_sm) {
        instance_norm::emulate_device({major, shared_per_cta, shared_per_sm, threads_per_sm});
      },
      "Testing only: choose paths as on a GPU of this compute capability major and these limits (bytes of shared "
      "memory per CTA and per SM, threads per SM); call before the first launch (kernels/instance_norm.h)",
      py::arg("major"), py::arg("shared_per_cta"), py::arg("shared_per_sm"), py::arg("threads_per_sm"));
}
