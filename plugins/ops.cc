// The tqexport custom-op library for ONNX Runtime: CacheWrite and PagedAttention of every
// cache format, reading the same node attributes as the TensorRT plugins. Every index taken
// from a tensor is checked before use; bad input returns an error status naming it.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "exp.h"
#include "formats.h"

#define TQX_STR2(x) #x
#define TQX_STR(x) TQX_STR2(x)

#ifndef TQX_SOURCE_HASH
#define TQX_SOURCE_HASH "unknown"
#endif

namespace tqx {
namespace {

const OrtApi* g_api = nullptr;

struct Error {
  std::string message;
};

OrtStatus* status(const std::string& op, int64_t layer, const std::string& what) {
  const std::string where = layer < 0 ? "" : " (layer " + std::to_string(layer) + ")";
  const std::string msg = "tqexport " + op + where + ": " + what;
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
}

// -- attributes -------------------------------------------------------------------------------
bool attr_string(const OrtKernelInfo* info, const char* name, std::string& out) {
  size_t size = 0;
  OrtStatus* st = g_api->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    g_api->ReleaseStatus(st);
    return false;
  }
  std::string buf(size, '\0');
  st = g_api->KernelInfoGetAttribute_string(info, name, buf.data(), &size);
  if (st) {
    g_api->ReleaseStatus(st);
    return false;
  }
  out.assign(buf.c_str());
  return true;
}

bool attr_int(const OrtKernelInfo* info, const char* name, int64_t& out) {
  OrtStatus* st = g_api->KernelInfoGetAttribute_int64(info, name, &out);
  if (st) g_api->ReleaseStatus(st);
  return st == nullptr;
}

bool attr_float(const OrtKernelInfo* info, const char* name, float& out) {
  OrtStatus* st = g_api->KernelInfoGetAttribute_float(info, name, &out);
  if (st) g_api->ReleaseStatus(st);
  return st == nullptr;
}

// The attributes both ops carry (tqexport.ops.attributes.cache_write_attrs).
struct CacheAttrs {
  std::string kv_cache_dtype, model_dtype;
  int64_t kv_heads = 0, head_size = 0, block_size = 0, layer = -1;
  float k_scale = 1.0f, v_scale = 1.0f;
  Format format;
  Elem model = Elem::float32;
};

std::string read_cache_attrs(const OrtKernelInfo* info, CacheAttrs& a) {
  attr_int(info, gen::attr::layer, a.layer);
  if (!attr_string(info, gen::attr::kv_cache_dtype, a.kv_cache_dtype))
    return "missing kv_cache_dtype";
  if (!attr_string(info, gen::attr::model_dtype, a.model_dtype)) return "missing model_dtype";
  if (!attr_int(info, gen::attr::num_kv_heads, a.kv_heads) || a.kv_heads < 1)
    return "missing or bad num_kv_heads";
  if (!attr_int(info, gen::attr::head_size, a.head_size)) return "missing head_size";
  if (!attr_int(info, gen::attr::block_size, a.block_size) || a.block_size < 1)
    return "missing or bad block_size";
  if (!attr_float(info, gen::attr::k_scale, a.k_scale) ||
      !attr_float(info, gen::attr::v_scale, a.v_scale))
    return "missing k_scale/v_scale";
  const gen::ModelDtype* model = nullptr;
  for (const auto& m : gen::kModelDtypes)
    if (a.model_dtype == m.name) model = &m;
  if (!model) return "unknown model_dtype '" + a.model_dtype + "'";
  a.model = model->elem;
  return resolve_format(a.format, a.kv_cache_dtype, a.model, static_cast<int>(a.head_size),
                        a.k_scale, a.v_scale);
}

// -- tensors ----------------------------------------------------------------------------------
ONNXTensorElementDataType onnx_type(Elem e) {
  switch (e) {
    case Elem::float32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case Elem::float16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case Elem::bfloat16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
}

struct Tensor {
  const OrtValue* value = nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

void check(OrtStatus* st) {
  if (st) {
    std::string msg = g_api->GetErrorMessage(st);
    g_api->ReleaseStatus(st);
    throw Error{msg};
  }
}

Tensor input(OrtKernelContext* ctx, size_t i) {
  Tensor t;
  check(g_api->KernelContext_GetInput(ctx, i, &t.value));
  if (!t.value) throw Error{"input " + std::to_string(i) + " is missing"};
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_api->GetTensorTypeAndShape(t.value, &info));
  size_t rank = 0;
  OrtStatus* st = g_api->GetTensorElementType(info, &t.type);
  if (!st) st = g_api->GetDimensionsCount(info, &rank);
  t.shape.resize(rank);
  if (!st) st = g_api->GetDimensions(info, t.shape.data(), rank);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  check(st);
  void* data = nullptr;  // inputs are only read (1.21's API has no const accessor)
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(t.value), &data));
  t.data = data;
  return t;
}

// Output i allocated with `shape` (or bound there by the caller); its data.
void* output(OrtKernelContext* ctx, size_t i, const std::vector<int64_t>& shape) {
  OrtValue* o = nullptr;
  check(g_api->KernelContext_GetOutput(ctx, i, shape.data(), shape.size(), &o));
  if (!o) throw Error{"output " + std::to_string(i) + " is missing"};
  void* p = nullptr;
  check(g_api->GetTensorMutableData(o, &p));
  return p;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

std::string type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    default: return "ONNX type " + std::to_string(t);
  }
}

void expect(const Tensor& t, const char* name, ONNXTensorElementDataType type,
            const std::vector<int64_t>& shape) {
  if (t.type != type)
    throw Error{std::string(name) + " has element type " + type_name(t.type) + ", expected " +
                type_name(type)};
  bool ok = t.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape[i];
  if (!ok) throw Error{std::string(name) + " has shape " + shape_str(t.shape) + ", expected " +
                      shape_str(shape) + " (-1: any)"};
}

// The cache tensors of a format at inputs [first, first + n): checked, viewed.
CacheView cache_inputs(OrtKernelContext* ctx, size_t first, const Format& f, int64_t block_size,
                       int64_t kv_heads, std::vector<Tensor>& out, const char* prefix) {
  CacheView view;
  int64_t blocks = -1;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    const TensorFmt& tf = f.tensors[i];
    Tensor t = input(ctx, first + i);
    std::vector<int64_t> shape{blocks, block_size, kv_heads};
    if (!tf.scalar) shape.push_back(tf.width);
    const std::string name = std::string(prefix) + tf.role;
    expect(t, name.c_str(), onnx_type(tf.elem), shape);
    if (t.shape[0] < 1) throw Error{name + " has no blocks"};
    blocks = t.shape[0];
    view.data[i] = static_cast<const uint8_t*>(t.data);
    view.width[i] = tf.width;
    view.elem[i] = elem_size(tf.elem);
    out.push_back(t);
  }
  return view;
}

template <typename T>
std::vector<int64_t> widen(const Tensor& t) {
  const T* p = static_cast<const T*>(t.data);
  return std::vector<int64_t>(p, p + t.numel());
}

std::vector<float> to_float(const void* data, Elem e, int64_t n) {
  std::vector<float> out(n);
  if (e == Elem::float32) {
    std::memcpy(out.data(), data, n * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = load_elem(data, e, i);
  }
  return out;
}

struct ParallelCtx {
  const std::function<void(size_t)>* fn;
};

void trampoline(void* user, size_t i) { (*static_cast<ParallelCtx*>(user)->fn)(i); }

void parallel(OrtKernelContext* ctx, size_t total, const std::function<void(size_t)>& fn) {
  if (total == 0) return;
  if (total == 1) {
    fn(0);
    return;
  }
  ParallelCtx pc{&fn};
  check(g_api->KernelContext_ParallelFor(ctx, trampoline, total, 0, &pc));
}

// The attention kernel of this process, chosen once.
const Kernel& attention_kernel() {
  static const Kernel kernel = pick_kernel();
  return kernel;
}

// kernel.compute(ctx), any error returned as a status naming op (and layer, where >= 0).
template <typename K>
OrtStatusPtr guarded(K& kernel, const char* op, int64_t layer, OrtKernelContext* ctx) {
  try {
    kernel.compute(ctx);
    return nullptr;
  } catch (const Error& e) {
    return status(op, layer, e.message);
  } catch (const std::exception& e) {
    return status(op, layer, e.what());
  }
}

// The element type of a model-dtype tensor (float32, float16 or bfloat16), else an error.
Elem float_elem(const Tensor& t, const char* name) {
  if (t.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return Elem::float32;
  if (t.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return Elem::float16;
  if (t.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) return Elem::bfloat16;
  throw Error{std::string(name) + " has element type " + type_name(t.type) +
              ", expected a float type"};
}

// Exactly `n` inputs, named in `what` for the error.
void expect_inputs(OrtKernelContext* ctx, size_t n, const char* what) {
  size_t count = 0;
  check(g_api->KernelContext_GetInputCount(ctx, &count));
  if (count != n)
    throw Error{"expected " + std::to_string(n) + " inputs (" + what + "), got " +
                std::to_string(count)};
}

// An op of one heterogeneous variadic input (at least kMinInputs tensors) and kOutputs outputs,
// which ONNX Runtime types as the first input (PagedAttention, AddBlockOffsets, RotateHalf,
// FusedAddRMSNorm, SiluAndMul).
template <typename Op, typename Kernel, int kMinInputs, size_t kOutputs = 1>
struct FirstTypedOp : Ort::CustomOpBase<Op, Kernel, true> {
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const {
    return INPUT_OUTPUT_VARIADIC;
  }
  int GetVariadicInputMinArity() const { return kMinInputs; }
  bool GetVariadicInputHomogeneity() const { return false; }
  size_t GetOutputTypeCount() const { return kOutputs; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
};

// -- CacheWrite -------------------------------------------------------------------------------
struct CacheWriteKernel {
  CacheAttrs a;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kCacheWrite, a.layer, ctx);
  }

  void compute(OrtKernelContext* ctx) {
    const Format& f = a.format;
    const size_t n = f.tensors.size();
    size_t count = 0;
    check(g_api->KernelContext_GetInputCount(ctx, &count));
    if (count != n + 3)
      throw Error{"expected " + std::to_string(n + 3) + " inputs (" + std::to_string(n) +
                  " cache tensors, k, v, slot_mapping) for " + a.kv_cache_dtype + ", got " +
                  std::to_string(count)};
    std::vector<Tensor> caches;
    cache_inputs(ctx, 0, f, a.block_size, a.kv_heads, caches, "cache ");
    const int64_t blocks = caches[0].shape[0];
    const Tensor k = input(ctx, n), v = input(ctx, n + 1), slots = input(ctx, n + 2);
    expect(slots, "slot_mapping", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, {-1});
    const int64_t tokens = slots.shape[0];
    expect(k, "k", onnx_type(a.model), {tokens, a.kv_heads, a.head_size});
    expect(v, "v", onnx_type(a.model), {tokens, a.kv_heads, a.head_size});
    const int64_t* slot = static_cast<const int64_t*>(slots.data);
    const int64_t rows = blocks * a.block_size;
    for (int64_t t = 0; t < tokens; ++t)
      if (slot[t] >= rows)
        throw Error{"slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot[t]) +
                    " is outside the cache (" + std::to_string(blocks) + " blocks of " +
                    std::to_string(a.block_size) + ")"};
    size_t outputs = 0;
    check(g_api->KernelContext_GetOutputCount(ctx, &outputs));
    if (outputs != n)
      throw Error{"expected " + std::to_string(n) + " outputs (the cache tensors of " +
                  a.kv_cache_dtype + "), got " + std::to_string(outputs)};
    std::vector<uint8_t*> out(n);
    for (size_t i = 0; i < n; ++i) {
      void* p = output(ctx, i, caches[i].shape);
      out[i] = static_cast<uint8_t*>(p);
      if (p != caches[i].data)  // not bound in place: the output starts as a copy
        std::memcpy(p, caches[i].data, caches[i].numel() * elem_size(f.tensors[i].elem));
    }
    const int64_t d = a.head_size, per_token = a.kv_heads * d;
    auto write = [&](int64_t t, int64_t row) {
      std::vector<float> kf = to_float(static_cast<const uint8_t*>(k.data) +
                                           t * per_token * elem_size(a.model), a.model, per_token);
      std::vector<float> vf = to_float(static_cast<const uint8_t*>(v.data) +
                                           t * per_token * elem_size(a.model), a.model, per_token);
      std::vector<float> scratch(d);
      for (int64_t h = 0; h < a.kv_heads; ++h)
        encode(f, kf.data() + h * d, vf.data() + h * d, out.data(), row * a.kv_heads + h,
               scratch.data());
    };
    parallel(ctx, static_cast<size_t>(tokens), [&](size_t t) {
      if (slot[t] >= 0) write(static_cast<int64_t>(t), slot[t]);
    });
    for (int64_t t = 0; t < tokens; ++t)  // padding lands in the null block's row 0, in order
      if (slot[t] < 0) write(t, 0);
  }
};

// -- PagedAttention ---------------------------------------------------------------------------
struct PagedAttentionKernel {
  CacheAttrs a;
  int64_t num_heads = 0, window = 0, recent_window = 0, sink_tokens = 0;
  float scale = 1.0f, softcap = 0.0f;
  Format recent_format;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kPagedAttention, a.layer, ctx);
  }

  static void check_table(const Tensor& t, const char* name, int64_t seqs, int64_t blocks) {
    expect(t, name, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, {seqs, -1});
    const int32_t* p = static_cast<const int32_t*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i)
      if (p[i] < 0 || p[i] >= blocks)
        throw Error{std::string(name) + "[" + std::to_string(i / std::max<int64_t>(t.shape[1], 1)) +
                    "][" + std::to_string(i % std::max<int64_t>(t.shape[1], 1)) + "] = " +
                    std::to_string(p[i]) + " is outside the cache's " + std::to_string(blocks) +
                    " blocks"};
  }

  void compute(OrtKernelContext* ctx) {
    const Format& f = a.format;
    const size_t n = f.tensors.size();
    const size_t expected = 1 + n + 4 + (recent_window ? 3 : 0);
    size_t count = 0;
    check(g_api->KernelContext_GetInputCount(ctx, &count));
    if (count != expected)
      throw Error{"expected " + std::to_string(expected) + " inputs for " + a.kv_cache_dtype +
                  (recent_window ? " with a recent window" : "") + ", got " +
                  std::to_string(count)};
    const Tensor q = input(ctx, 0);
    expect(q, "q", onnx_type(a.model), {-1, num_heads, a.head_size});
    const int64_t tokens = q.shape[0];
    std::vector<Tensor> caches;
    AttentionStep s{};
    s.main.format = &f;
    s.main.view = cache_inputs(ctx, 1, f, a.block_size, a.kv_heads, caches, "cache ");
    const int64_t blocks = caches[0].shape[0];
    const Tensor tables = input(ctx, 1 + n), lens = input(ctx, 2 + n);
    const Tensor starts = input(ctx, 3 + n), positions = input(ctx, 4 + n);
    expect(lens, "seq_lens", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, {-1});
    const int64_t seqs = lens.shape[0];
    check_table(tables, "block_tables", seqs, blocks);
    expect(starts, "query_start_loc", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, {seqs + 1});
    expect(positions, "positions", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, {tokens});
    const int64_t* position = static_cast<const int64_t*>(positions.data);
    for (int64_t t = 0; t < tokens; ++t)  // (window arithmetic is then free of overflow)
      if (position[t] < 0)
        throw Error{"positions[" + std::to_string(t) + "] = " + std::to_string(position[t]) +
                    " is negative"};
    std::vector<int64_t> seq_lens = widen<int32_t>(lens), query_start = widen<int32_t>(starts);
    const int64_t width = tables.shape[1];
    for (int64_t i = 0; i < seqs; ++i) {
      if (seq_lens[i] < 0 || seq_lens[i] > width * a.block_size)
        throw Error{"seq_lens[" + std::to_string(i) + "] = " + std::to_string(seq_lens[i]) +
                    " is beyond its block table (" + std::to_string(width) + " blocks of " +
                    std::to_string(a.block_size) + ")"};
    }
    for (int64_t i = 0; i <= seqs; ++i) {
      const int64_t lo = i ? query_start[i - 1] : 0;
      if (query_start[i] < lo || query_start[i] > tokens)
        throw Error{"query_start_loc[" + std::to_string(i) + "] = " +
                    std::to_string(query_start[i]) + " is not in [" + std::to_string(lo) + ", " +
                    std::to_string(tokens) + "]"};
    }
    s.main.table = static_cast<const int32_t*>(tables.data);
    s.main.width = width;
    std::vector<Tensor> recent;
    if (recent_window) {
      s.recent.format = &recent_format;
      s.recent.view = cache_inputs(ctx, 5 + n, recent_format, a.block_size, a.kv_heads, recent,
                                   "recent cache ");
      const Tensor rt = input(ctx, 7 + n);
      check_table(rt, "recent_block_tables", seqs, recent[0].shape[0]);
      s.recent.table = static_cast<const int32_t*>(rt.data);
      s.recent.width = rt.shape[1];
    }
    std::vector<int64_t> dims{tokens, num_heads, a.head_size};
    void* out_data = output(ctx, 0, dims);
    const int64_t numel = tokens * num_heads * a.head_size;
    std::vector<float> qf, of;
    if (a.model == Elem::float32) {
      s.q = static_cast<const float*>(q.data);
      s.out = static_cast<float*>(out_data);
    } else {
      qf = to_float(q.data, a.model, numel);
      of.resize(numel);
      s.q = qf.data();
      s.out = of.data();
    }
    s.format = &f;
    s.num_heads = static_cast<int>(num_heads);
    s.kv_heads = static_cast<int>(a.kv_heads);
    s.head_size = static_cast<int>(a.head_size);
    s.block_size = static_cast<int>(a.block_size);
    s.scale = scale;
    s.softcap = softcap;
    s.window = window;
    s.recent_window = recent_window;
    s.sink_tokens = sink_tokens;
    s.seq_lens = seq_lens.data();
    s.query_start = query_start.data();
    s.positions = position;
    s.num_seqs = seqs;
    s.num_tokens = tokens;
    paged_attention(s, attention_kernel().run, [&](size_t total, const std::function<void(size_t)>& fn) {
      parallel(ctx, total, fn);
    });
    if (a.model != Elem::float32)
      for (int64_t i = 0; i < numel; ++i) store_elem(out_data, a.model, i, of[i]);
  }
};

// -- op schemas -------------------------------------------------------------------------------
template <typename Kernel>
OrtStatusPtr create_kernel(const char* op, const OrtKernelInfo* info, void** kernel,
                           std::string (*setup)(const OrtKernelInfo*, Kernel&)) {
  auto k = std::make_unique<Kernel>();
  std::string err = read_cache_attrs(info, k->a);
  if (err.empty()) err = setup(info, *k);
  if (!err.empty()) return status(op, k->a.layer, err);
  *kernel = k.release();
  return nullptr;
}

struct CacheWriteOp : Ort::CustomOpBase<CacheWriteOp, CacheWriteKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel<CacheWriteKernel>(
        gen::kCacheWrite, info, kernel, [](const OrtKernelInfo*, CacheWriteKernel&) {
          return std::string();
        });
  }
  const char* GetName() const { return gen::kCacheWrite; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const {
    return INPUT_OUTPUT_VARIADIC;
  }
  int GetVariadicInputMinArity() const { return 4; }
  bool GetVariadicInputHomogeneity() const { return false; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const {
    return INPUT_OUTPUT_VARIADIC;
  }
  int GetVariadicOutputMinArity() const { return 1; }
  bool GetVariadicOutputHomogeneity() const { return false; }
};

std::string setup_attention(const OrtKernelInfo* info, PagedAttentionKernel& k) {
  if (!attr_int(info, gen::attr::num_heads, k.num_heads) || k.num_heads < 1 ||
      k.num_heads % k.a.kv_heads)
    return "num_heads must be a positive multiple of num_kv_heads";
  if (!attr_float(info, gen::attr::scale, k.scale)) return "missing scale";
  attr_float(info, gen::attr::softcap, k.softcap);
  attr_int(info, gen::attr::window, k.window);
  attr_int(info, gen::attr::recent_window, k.recent_window);
  attr_int(info, gen::attr::sink_tokens, k.sink_tokens);
  if (k.window < 0 || k.recent_window < 0 || k.sink_tokens < 0)
    return "window, recent_window and sink_tokens must be >= 0";
  if (k.sink_tokens && !k.recent_window) return "sink_tokens need a recent_window";
  if (k.recent_window)
    return resolve_format(k.recent_format, "auto", k.a.model,
                          static_cast<int>(k.a.head_size), 1.0f, 1.0f);
  return "";
}

struct PagedAttentionOp : FirstTypedOp<PagedAttentionOp, PagedAttentionKernel, 6> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel<PagedAttentionKernel>(gen::kPagedAttention, info, kernel,
                                               setup_attention);
  }
  const char* GetName() const { return gen::kPagedAttention; }
};

// -- AddBlockOffsets --------------------------------------------------------------------------
// sums[i] = the sum of x[i * block, (i + 1) * block) for i < count (summed in any order).
__attribute__((target_clones("avx512f", "avx2", "default"),
               optimize("fp-contract=fast", "associative-math", "no-signed-zeros",
                        "no-trapping-math"))) void
block_sums(const float* x, int64_t count, int64_t block, float* sums) {
  for (int64_t i = 0; i < count; ++i) {
    float s = 0.0f;
    for (int64_t j = 0; j < block; ++j) s += x[i * block + j];
    sums[i] = s;
  }
}

constexpr int64_t kOffsetsWidth = 32;  // columns of an AddBlockOffsets tile

// Rows [r, r + R) x columns [c, c + kOffsetsWidth) of out = y + sums @ offsets, accumulated in
// registers: each row of offsets read once for the R rows.
template <int64_t R>
__attribute__((always_inline)) inline void offsets_tile(const float* sums, const float* offsets,
                                                        const float* y, float* out, int64_t r,
                                                        int64_t blocks, int64_t n, int64_t c) {
  float acc[R][kOffsetsWidth];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < kOffsetsWidth; ++j) acc[i][j] = y[(r + i) * n + c + j];
  for (int64_t b = 0; b < blocks; ++b) {
    const float* m = offsets + b * n + c;
    for (int64_t i = 0; i < R; ++i) {
      const float s = sums[(r + i) * blocks + b];
      for (int64_t j = 0; j < kOffsetsWidth; ++j) acc[i][j] += s * m[j];
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < kOffsetsWidth; ++j) out[(r + i) * n + c + j] = acc[i][j];
}

// out[r, c] = y[r, c] + sum_b sums[r, b] * offsets[b, c] over the columns [c0, c1): tiles of 8
// rows (a prefill), then of one (a decode step), the columns past the last tile one at a time;
// compiled for AVX-512, AVX2 and the baseline, the CPU's chosen at load, with fused
// multiply-adds where the CPU has them.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=fast"))) void
add_offsets(const float* sums, const float* offsets, const float* y, float* out, int64_t rows,
            int64_t blocks, int64_t n, int64_t c0, int64_t c1) {
  constexpr int64_t kRows = 8;
  const int64_t tiled = rows - rows % kRows, end = c0 + (c1 - c0) / kOffsetsWidth * kOffsetsWidth;
  for (int64_t c = c0; c < end; c += kOffsetsWidth) {
    for (int64_t r = 0; r < tiled; r += kRows)
      offsets_tile<kRows>(sums, offsets, y, out, r, blocks, n, c);
    for (int64_t r = tiled; r < rows; ++r) offsets_tile<1>(sums, offsets, y, out, r, blocks, n, c);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = end; c < c1; ++c) {
      float acc = y[r * n + c];
      for (int64_t b = 0; b < blocks; ++b) acc += sums[r * blocks + b] * offsets[b * n + c];
      out[r * n + c] = acc;
    }
}

struct AddBlockOffsetsKernel {
  int64_t block = 0;  // block_size

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kAddBlockOffsets, -1, ctx);
  }

  void compute(OrtKernelContext* ctx) {
    expect_inputs(ctx, 3, "x, y, offsets");
    const Tensor x = input(ctx, 0), y = input(ctx, 1), offsets = input(ctx, 2);
    const Elem e = float_elem(x, "x");
    expect(offsets, "offsets", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, {-1, -1});
    const int64_t blocks = offsets.shape[0], n = offsets.shape[1], k = blocks * block;
    if (x.shape.empty() || x.shape.back() != k)
      throw Error{"x has shape " + shape_str(x.shape) + ", expected [..., " + std::to_string(k) +
                  "] (offsets has " + std::to_string(blocks) + " blocks of " +
                  std::to_string(block) + ")"};
    std::vector<int64_t> y_shape(x.shape);
    y_shape.back() = n;
    expect(y, "y", x.type, y_shape);
    int64_t rows = 1;  // x's leading axes, flattened
    for (size_t i = 0; i + 1 < x.shape.size(); ++i) rows *= x.shape[i];
    void* out = output(ctx, 0, y_shape);
    if (rows == 0 || n == 0) return;
    std::vector<float> x32, sums(static_cast<size_t>(rows * blocks));
    const float* xs = static_cast<const float*>(x.data);
    if (e != Elem::float32) {
      x32 = to_float(x.data, e, rows * k);
      xs = x32.data();
    }
    const int64_t sum_tasks = std::clamp<int64_t>((rows * k) >> 18, 1, rows);
    const int64_t sum_span = (rows + sum_tasks - 1) / sum_tasks;
    parallel(ctx, static_cast<size_t>(sum_tasks), [&](size_t task) {
      const int64_t r0 = static_cast<int64_t>(task) * sum_span;
      const int64_t count = std::min(rows, r0 + sum_span) - r0;
      if (count > 0) block_sums(xs + r0 * k, count * blocks, block, sums.data() + r0 * blocks);
    });
    // float32 rows as they are; other float types through float32 copies of y and out
    std::vector<float> y32, out32;
    const float* ys = static_cast<const float*>(y.data);
    float* os = static_cast<float*>(out);
    if (e != Elem::float32) {
      y32 = to_float(y.data, e, rows * n);
      out32.resize(y32.size());
      ys = y32.data();
      os = out32.data();
    }
    const float* offs = static_cast<const float*>(offsets.data);
    // tasks of whole column ranges; one task unless the work outweighs waking ORT's threads
    const int64_t work = rows * n * std::max<int64_t>(blocks, 1);
    const int64_t tiles = (n + kOffsetsWidth - 1) / kOffsetsWidth;
    const int64_t tasks = std::clamp<int64_t>(work >> 20, 1, tiles);
    const int64_t span = (tiles + tasks - 1) / tasks * kOffsetsWidth;  // whole tiles per task
    parallel(ctx, static_cast<size_t>(tasks), [&](size_t task) {
      const int64_t c0 = static_cast<int64_t>(task) * span, c1 = std::min(n, c0 + span);
      if (c0 < c1) add_offsets(sums.data(), offs, ys, os, rows, blocks, n, c0, c1);
    });
    if (e != Elem::float32)
      for (int64_t i = 0; i < rows * n; ++i) store_elem(out, e, i, out32[i]);
  }
};

// x, y (the model's float) and offsets (float32): the output typed as x
struct AddBlockOffsetsOp : FirstTypedOp<AddBlockOffsetsOp, AddBlockOffsetsKernel, 3> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto k = std::make_unique<AddBlockOffsetsKernel>();
    if (!attr_int(info, gen::attr::block_size, k->block) || k->block < 1)
      return status(gen::kAddBlockOffsets, -1, "missing or bad block_size (a positive size)");
    *kernel = k.release();
    return nullptr;
  }
  const char* GetName() const { return gen::kAddBlockOffsets; }
};

// -- RotateHalf -------------------------------------------------------------------------------
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[h:], x[:h]] over the last axis of
// D = 2h, cos and sin broadcast to x's shape; each product rounded, then their sum (the order
// the unfused ONNX ops round in, so float32 results are theirs, bit for bit).
struct RotateHalfKernel {
  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kRotateHalf, -1, ctx);
  }

  // Element strides of `t` over x's index space (0 where t broadcasts), checked against x.
  static std::vector<int64_t> broadcast_strides(const Tensor& t, const char* name,
                                                const Tensor& x) {
    const size_t rank = x.shape.size();
    bool ok = t.shape.size() <= rank && t.type == x.type;
    std::vector<int64_t> strides(rank, 0);
    int64_t stride = 1;
    for (size_t i = 0; ok && i < t.shape.size(); ++i) {
      const size_t d = t.shape.size() - 1 - i, xd = rank - 1 - i;
      ok = t.shape[d] == x.shape[xd] || (t.shape[d] == 1 && i > 0);
      strides[xd] = t.shape[d] == 1 ? 0 : stride;
      stride *= t.shape[d];
    }
    if (!ok)
      throw Error{std::string(name) + " (" + type_name(t.type) + ", shape " +
                  shape_str(t.shape) + ") does not broadcast to x (" + type_name(x.type) +
                  ", shape " + shape_str(x.shape) + "): same type, same last axis"};
    return strides;
  }

  void compute(OrtKernelContext* ctx) {
    expect_inputs(ctx, 3, "x, cos, sin");
    const Tensor x = input(ctx, 0), c = input(ctx, 1), s = input(ctx, 2);
    const Elem e = float_elem(x, "x");
    if (x.shape.empty() || x.shape.back() < 2 || x.shape.back() % 2)
      throw Error{"x has shape " + shape_str(x.shape) + ", expected [..., D] with D even"};
    const std::vector<int64_t> cs = broadcast_strides(c, "cos", x),
                               ss = broadcast_strides(s, "sin", x);
    void* out = output(ctx, 0, x.shape);
    const int64_t d = x.shape.back(), h = d / 2, rows = x.numel() / d;
    if (rows == 0) return;
    const int lead = static_cast<int>(x.shape.size()) - 1;
    const int64_t tasks = std::clamp<int64_t>((rows * d) >> 16, 1, rows);
    const int64_t span = (rows + tasks - 1) / tasks;
    parallel(ctx, static_cast<size_t>(tasks), [&](size_t task) {
      const int64_t r0 = static_cast<int64_t>(task) * span, r1 = std::min(rows, r0 + span);
      const bool f32 = e == Elem::float32;  // float32 in place; other types through copies
      std::vector<float> xr(f32 ? 0 : d), cr(f32 ? 0 : d), sr(f32 ? 0 : d), yr(f32 ? 0 : d);
      for (int64_t r = r0; r < r1; ++r) {
        int64_t co = 0, so = 0;  // r's row in cos and sin: its index over x's leading axes
        for (int64_t i = lead - 1, rest = r; i >= 0; --i) {
          const int64_t at = rest % x.shape[i];
          rest /= x.shape[i];
          co += at * cs[i];
          so += at * ss[i];
        }
        const float *xp = xr.data(), *cp = cr.data(), *sp = sr.data();
        float* yp = yr.data();
        if (f32) {
          xp = static_cast<const float*>(x.data) + r * d;
          cp = static_cast<const float*>(c.data) + co;
          sp = static_cast<const float*>(s.data) + so;
          yp = static_cast<float*>(out) + r * d;
        } else {
          for (int64_t i = 0; i < d; ++i) {
            xr[i] = load_elem(x.data, e, r * d + i);
            cr[i] = load_elem(c.data, e, co + i);
            sr[i] = load_elem(s.data, e, so + i);
          }
        }
        for (int64_t i = 0; i < h; ++i) {
          yp[i] = xp[i] * cp[i] + (-xp[i + h]) * sp[i];
          yp[i + h] = xp[i + h] * cp[i + h] + xp[i] * sp[i + h];
        }
        if (!f32)
          for (int64_t i = 0; i < d; ++i) store_elem(out, e, r * d + i, yr[i]);
      }
    });
  }
};

// x, cos and sin: the output typed as x
struct RotateHalfOp : FirstTypedOp<RotateHalfOp, RotateHalfKernel, 3> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new RotateHalfKernel();
    return nullptr;
  }
  const char* GetName() const { return gen::kRotateHalf; }
};

// -- FusedAddRMSNorm --------------------------------------------------------------------------
// sum = x + residual, out = sum / sqrt(mean(sum^2) + epsilon) * weight over each row's last axis
// (float32 rows; the sums exact, the mean's order free).
__attribute__((target_clones("avx512f", "avx2", "default"),
               optimize("fp-contract=fast", "associative-math", "no-signed-zeros",
                        "no-trapping-math"))) void
add_rms_norm_rows(const float* x, const float* residual, const float* weight, float epsilon,
                  int64_t rows, int64_t d, float* out, float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * d, *rr = residual + r * d;
    float *sr = sum + r * d, *orow = out + r * d;
    float squares = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      sr[i] = xr[i] + rr[i];
      squares += sr[i] * sr[i];
    }
    const float root = std::sqrt(squares / static_cast<float>(d) + epsilon);
    for (int64_t i = 0; i < d; ++i) orow[i] = sr[i] / root * weight[i];
  }
}

struct FusedAddRMSNormKernel {
  float epsilon = 0.0f;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kFusedAddRMSNorm, -1, ctx);
  }

  void compute(OrtKernelContext* ctx) {
    expect_inputs(ctx, 3, "x, residual, weight");
    const Tensor x = input(ctx, 0), res = input(ctx, 1), w = input(ctx, 2);
    const Elem e = float_elem(x, "x");
    if (x.shape.empty() || x.shape.back() < 1)
      throw Error{"x has shape " + shape_str(x.shape) + ", expected [..., D] with D >= 1"};
    const int64_t d = x.shape.back(), rows = x.numel() / d;
    expect(res, "residual", x.type, x.shape);
    expect(w, "weight", x.type, {d});
    void* out = output(ctx, 0, x.shape);
    void* sum = output(ctx, 1, x.shape);
    if (rows == 0) return;
    const int64_t tasks = std::clamp<int64_t>((rows * d) >> 16, 1, rows);
    const int64_t span = (rows + tasks - 1) / tasks;
    parallel(ctx, static_cast<size_t>(tasks), [&](size_t task) {
      const int64_t r0 = static_cast<int64_t>(task) * span, r1 = std::min(rows, r0 + span);
      if (r0 >= r1) return;
      if (e == Elem::float32) {
        add_rms_norm_rows(static_cast<const float*>(x.data) + r0 * d,
                          static_cast<const float*>(res.data) + r0 * d,
                          static_cast<const float*>(w.data), epsilon, r1 - r0, d,
                          static_cast<float*>(out) + r0 * d, static_cast<float*>(sum) + r0 * d);
        return;
      }
      // other float types: the sum rounded to the type (as an Add of it), then normed in
      // float32 (its sum with zero: the rounded sum again)
      const std::vector<float> wf = to_float(w.data, e, d), zeros(d, 0.0f);
      std::vector<float> sr(d), orow(d), unused(d);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < d; ++i) {
          store_elem(sum, e, r * d + i, load_elem(x.data, e, r * d + i) +
                                            load_elem(res.data, e, r * d + i));
          sr[i] = load_elem(sum, e, r * d + i);
        }
        add_rms_norm_rows(sr.data(), zeros.data(), wf.data(), epsilon, 1, d, orow.data(),
                          unused.data());
        for (int64_t i = 0; i < d; ++i) store_elem(out, e, r * d + i, orow[i]);
      }
    });
  }
};

// x, residual and weight, all of the model's float type: out and sum typed as x
struct FusedAddRMSNormOp : FirstTypedOp<FusedAddRMSNormOp, FusedAddRMSNormKernel, 3, 2> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto k = std::make_unique<FusedAddRMSNormKernel>();
    if (!attr_float(info, gen::attr::epsilon, k->epsilon) || !(k->epsilon >= 0.0f))
      return status(gen::kFusedAddRMSNorm, -1, "missing or bad epsilon (a float >= 0)");
    *kernel = k.release();
    return nullptr;
  }
  const char* GetName() const { return gen::kFusedAddRMSNorm; }
};

// -- SiluAndMul --------------------------------------------------------------------------------
// out[i] = silu(gate[i]) * up[i], silu(g) = g * sigmoid(g) with sigmoid(g) = 1 / (1 + e) for
// g >= 0, else e / (1 + e), e = exp(-|g|) (no overflow on either side)
__attribute__((target_clones("avx512f", "avx2", "default"),
               optimize("fp-contract=fast", "no-trapping-math"))) void
silu_and_mul_row(const float* __restrict gate, const float* __restrict up, int64_t f,
                 float* __restrict out) {
  for (int64_t i = 0; i < f; ++i) {
    const float g = gate[i], e = exp_neg(-__builtin_fabsf(g));  // std::fabs: not inlined here
    out[i] = g * (g >= 0.0f ? 1.0f : e) / (1.0f + e) * up[i];
  }
}

struct SiluAndMulKernel {
  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    return guarded(*this, gen::kSiluAndMul, -1, ctx);
  }

  void compute(OrtKernelContext* ctx) {
    expect_inputs(ctx, 1, "x");
    const Tensor x = input(ctx, 0);
    const Elem e = float_elem(x, "x");
    if (x.shape.empty() || x.shape.back() < 2 || x.shape.back() % 2)
      throw Error{"x has shape " + shape_str(x.shape) + ", expected [..., 2F] (gate, up)"};
    const int64_t f = x.shape.back() / 2, rows = x.numel() / (2 * f);
    std::vector<int64_t> out_shape(x.shape);
    out_shape.back() = f;
    void* out = output(ctx, 0, out_shape);
    if (rows == 0) return;
    const int64_t tasks = std::clamp<int64_t>((rows * f) >> 15, 1, rows);
    const int64_t span = (rows + tasks - 1) / tasks;
    parallel(ctx, static_cast<size_t>(tasks), [&](size_t task) {
      const int64_t r0 = static_cast<int64_t>(task) * span, r1 = std::min(rows, r0 + span);
      if (r0 >= r1) return;
      if (e == Elem::float32) {
        const float* xs = static_cast<const float*>(x.data);
        for (int64_t r = r0; r < r1; ++r)
          silu_and_mul_row(xs + r * 2 * f, xs + r * 2 * f + f, f, static_cast<float*>(out) + r * f);
        return;
      }
      std::vector<float> xr(2 * f), orow(f);  // other float types: a row at a time in float32
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < 2 * f; ++i) xr[i] = load_elem(x.data, e, r * 2 * f + i);
        silu_and_mul_row(xr.data(), xr.data() + f, f, orow.data());
        for (int64_t i = 0; i < f; ++i) store_elem(out, e, r * f + i, orow[i]);
      }
    });
  }
};

// x of the model's float type: the output typed as x
struct SiluAndMulOp : FirstTypedOp<SiluAndMulOp, SiluAndMulKernel, 1> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new SiluAndMulKernel();
    return nullptr;
  }
  const char* GetName() const { return gen::kSiluAndMul; }
};

CacheWriteOp g_cache_write;
PagedAttentionOp g_paged_attention;
AddBlockOffsetsOp g_add_block_offsets;
RotateHalfOp g_rotate_half;
FusedAddRMSNormOp g_fused_add_rms_norm;
SiluAndMulOp g_silu_and_mul;

}  // namespace
}  // namespace tqx

extern "C" {

// What this library was built from, for the loader's staleness check.
__attribute__((visibility("default"))) const char* tqx_build_info() {
  return "{\"ort_api_version\": " TQX_STR(ORT_API_VERSION) ", \"source_hash\": \"" TQX_SOURCE_HASH
         "\"}";
}

// The instruction set of the attention kernel this process runs (avx512, avx2 or base).
__attribute__((visibility("default"))) const char* tqx_attention_kernel() {
  return tqx::attention_kernel().name;
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) return nullptr;  // an older runtime: nothing can be reported through its API
  tqx::g_api = api;
  Ort::InitApi(api);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = api->CreateCustomOpDomain(tqx::gen::kDomain, &domain)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_cache_write)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_paged_attention)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_add_block_offsets)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_rotate_half)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_fused_add_rms_norm)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, &tqx::g_silu_and_mul)) return st;
  return api->AddCustomOpDomain(options, domain);
}

}  // extern "C"
