// The HDF5 side of the tensor archive: the atomic write and the validating read. Layout and the reasons
// for it are in docs/checkpoint-format.md.
//
// Every HDF5 call's return code is checked (KILN_H5 below); a failure becomes a kiln::Error with the file,
// what was being done, the failing call and HDF5's own explanation taken from its error stack. HDF5's
// automatic printing of that stack is switched off while the archive works, so users see one message.
// The serial HDF5 library is not thread-safe, hence one process-wide mutex around save() and load().
#include <kiln/core/archive/archive.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <hdf5.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <type_traits>

#include <kiln/autograd/grad_mode.h>

namespace kiln::archive {

namespace {

// The f16 type below is little-endian and doubles as the in-memory type.
static_assert(std::endian::native == std::endian::little, "archive: big-endian hosts need big-endian memory types");

// ---- errors ----

herr_t collect_error(unsigned, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  out->emplace_back(e->desc ? e->desc : "");
  return 0;
}

// HDF5's explanation of the last failure: the outermost message (what the API call was doing) and the
// innermost one (the cause, e.g. "truncated file: eof = ..."). Clears the stack.
std::string h5_detail() {
  std::vector<std::string> descs;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_error, &descs);
  H5Eclear2(H5E_DEFAULT);
  if (descs.empty()) return "no detail from HDF5";
  if (descs.size() == 1 || descs.front() == descs.back()) return descs.front();
  return descs.front() + ": " + descs.back();
}

// KILN_H5(call, message...) evaluates an HDF5 call and throws kiln::Error with the message, the call and
// HDF5's detail when it returns a negative value (every HDF5 error code is negative).
#define KILN_H5(call, ...)                                                                                  \
  [&] {                                                                                                     \
    auto result_ = (call);                                                                                  \
    if (result_ < 0)                                                                                        \
      ::kiln::detail::throw_error(__FILE__, __LINE__,                                                       \
                                  ::kiln::detail::concat(__VA_ARGS__, " [", #call, ": ", h5_detail(), "]")); \
    return result_;                                                                                         \
  }()

// Owns an HDF5 identifier. Destructors ignore close errors (they run during unwinding); objects that were
// written are closed explicitly with a checked call on the success path.
class Id {
 public:
  Id() = default;
  Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Id(Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  ~Id() { reset(); }
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // NOLINT: pass straight to HDF5 calls
  hid_t release() {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    return id;
  }
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = H5I_INVALID_HID;
  }
  // Closes now and returns HDF5's result, for the success path where a failed close (data that could not
  // be written out) must be reported.
  herr_t close() { return id_ >= 0 && close_ ? close_(release()) : 0; }

 private:
  hid_t id_ = H5I_INVALID_HID;
  herr_t (*close_)(hid_t) = nullptr;
};

// One archive operation at a time, with HDF5's error printing off; restores the caller's handler.
class Session {
 public:
  Session() : lock_(mutex()) {
    H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~Session() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock_;
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

// ---- types ----

// IEEE binary16, little-endian: sign bit 15, exponent bits 10..14 (bias 15), mantissa bits 0..9.
// h5py and h5dump recognise it as a 16-bit float.
Id half_type(const std::string& ctx) {
  Id t(KILN_H5(H5Tcopy(H5T_IEEE_F32LE), ctx), H5Tclose);
  KILN_H5(H5Tset_fields(t, 15, 10, 5, 0, 10), ctx);
  KILN_H5(H5Tset_precision(t, 16), ctx);  // before shrinking the size, or the 32-bit precision no longer fits
  KILN_H5(H5Tset_size(t, 2), ctx);
  KILN_H5(H5Tset_ebias(t, 15), ctx);
  return t;
}

// The stored type of each dtype; it is also the in-memory type handed to H5Dread/H5Dwrite because Kiln's
// storage is little-endian with the same layouts. bf16 has no HDF5 float equivalent that readers agree
// on, so it is stored as its raw bits (uint16); bool as uint8 0/1; f8e4m3 and f8e5m2 as their raw bits
// (uint8), the dtype attribute saying which.
Id file_type(DType dt, const std::string& ctx) {
  hid_t base = H5I_INVALID_HID;
  switch (dt) {
    case DType::f32: base = H5T_IEEE_F32LE; break;
    case DType::f64: base = H5T_IEEE_F64LE; break;
    case DType::f16: return half_type(ctx);
    case DType::bf16: base = H5T_STD_U16LE; break;
    case DType::i32: base = H5T_STD_I32LE; break;
    case DType::i64: base = H5T_STD_I64LE; break;
    case DType::boolean: case DType::f8e4m3: case DType::f8e5m2: base = H5T_STD_U8LE; break;
  }
  return Id(KILN_H5(H5Tcopy(base), ctx), H5Tclose);
}

// Whether a stored HDF5 type holds a dtype's values exactly: same class, size and signedness.
bool type_matches(hid_t type, DType dt, const std::string& ctx) {
  H5T_class_t cls = KILN_H5(H5Tget_class(type), ctx);
  size_t size = H5Tget_size(type);
  KILN_CHECK(size > 0, ctx, ": cannot get the size of the stored type [", h5_detail(), "]");
  if (size != element_size(dt)) return false;
  if (is_floating(dt) && dt != DType::bf16 && !is_fp8(dt)) return cls == H5T_FLOAT;
  if (cls != H5T_INTEGER) return false;
  H5T_sign_t sign = KILN_H5(H5Tget_sign(type), ctx);
  bool want_signed = dt == DType::i32 || dt == DType::i64;
  return (sign == H5T_SGN_2) == want_signed;
}

std::string type_description(hid_t type) {
  H5T_class_t cls = H5Tget_class(type);
  size_t size = H5Tget_size(type);
  const char* name = cls == H5T_INTEGER ? (H5Tget_sign(type) == H5T_SGN_2 ? "signed integer" : "unsigned integer")
                     : cls == H5T_FLOAT ? "float"
                     : cls == H5T_STRING ? "string"
                                         : "non-numeric type";
  H5Eclear2(H5E_DEFAULT);
  return std::to_string(size * 8) + "-bit " + name;
}

// Strings are fixed-length (NUL-padded UTF-8 of exactly the text's size), not variable-length: those live
// in HDF5's global heap, which has no checksum, and a damaged global heap can send HDF5 into an endless
// loop. Fixed-length strings sit inside the checksummed object header. `size` 0 means variable-length
// (only for reading other writers' files).
Id string_type(size_t size, const std::string& ctx) {
  Id t(KILN_H5(H5Tcopy(H5T_C_S1), ctx), H5Tclose);
  KILN_H5(H5Tset_size(t, size == 0 ? H5T_VARIABLE : size), ctx);
  if (size != 0) KILN_H5(H5Tset_strpad(t, H5T_STR_NULLPAD), ctx);
  KILN_H5(H5Tset_cset(t, H5T_CSET_UTF8), ctx);
  return t;
}

// ---- writing ----

// Validated layout: the group components and dataset name of every tensor, and where each attribute goes.
struct Plan {
  std::vector<std::vector<std::string>> tensor_parts;
  std::vector<std::pair<std::vector<std::string>, std::string>> attribute_parts;
};

std::string join(const std::vector<std::string>& parts, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += "/" + parts[i];
  return s.empty() ? "/" : s;
}

// Checks every name before any file is created: an invalid archive must not cost the old checkpoint.
Plan plan_layout(const std::string& path, const Archive& a) {
  Plan plan;
  std::set<std::string> datasets, groups{"/"};
  for (const auto& [name, t] : a.tensors) {
    KILN_CHECK(t.defined(), "archive::save: '", path, "': tensor '", name, "' is undefined");
    std::vector<std::string> parts = split_tensor_name(name);
    std::string full = join(parts, parts.size());
    KILN_CHECK(datasets.insert(full).second, "archive::save: '", path, "': two tensors map to ", full,
               " (names are the same up to '.' vs '/'); the second is '", name, "'");
    for (size_t i = 1; i < parts.size(); ++i) groups.insert(join(parts, i));
    plan.tensor_parts.push_back(std::move(parts));
  }
  for (const auto& [key, value] : a.attributes) {
    auto [gparts, attr] = split_attribute_key(key);
    if (const auto* s = std::get_if<std::string>(&value))
      KILN_CHECK(s->find('\0') == std::string::npos, "archive::save: '", path, "': string attribute '", key,
                 "' contains a NUL byte");
    for (size_t i = 1; i <= gparts.size(); ++i) groups.insert(join(gparts, i));
    plan.attribute_parts.emplace_back(std::move(gparts), std::move(attr));
  }
  for (const std::string& d : datasets)
    KILN_CHECK(!groups.count(d), "archive::save: '", path, "': ", d,
               " would be both a tensor and a group (a tensor name is a prefix of another name or attribute key)");
  return plan;
}

// The finished file: bytes HDF5's core driver allocated (through the callbacks below), owned by us.
struct Image {
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> data;
  size_t size = 0;
};

// Memory of the in-memory file, allocated by HDF5 through file-image callbacks so that the image can be
// taken over when HDF5 closes the file (after it has written the final superblock) instead of copied:
// H5Fget_file_image would double the memory, and in HDF5 1.10.8 it also writes a wrong superblock checksum.
struct ImageMemory {
  void* data = nullptr;
  ~ImageMemory() { std::free(data); }

  static void* malloc_cb(size_t size, H5FD_file_image_op_t, void* udata) {
    void* p = std::malloc(size);
    if (p) static_cast<ImageMemory*>(udata)->data = p;
    return p;
  }
  static void* memcpy_cb(void* dst, const void* src, size_t size, H5FD_file_image_op_t, void*) {
    return std::memcpy(dst, src, size);
  }
  static void* realloc_cb(void* ptr, size_t size, H5FD_file_image_op_t, void* udata) {
    void* p = std::realloc(ptr, size);
    if (p) static_cast<ImageMemory*>(udata)->data = p;
    return p;
  }
  static herr_t free_cb(void* ptr, H5FD_file_image_op_t op, void* udata) {
    if (op == H5FD_FILE_IMAGE_OP_FILE_CLOSE) return 0;  // the closed file's image: ours to keep (see data)
    auto* m = static_cast<ImageMemory*>(udata);
    if (ptr == m->data) m->data = nullptr;
    std::free(ptr);
    return 0;
  }
  static void* udata_copy_cb(void* udata) { return udata; }  // property-list copies share this object
  static herr_t udata_free_cb(void*) { return 0; }
};

// Builds the file in memory (HDF5's core driver, no backing store) and hands back its bytes; save() writes
// them. HDF5 never touches the disk: when HDF5's own writes fail (disk full, quota, I/O error) its cleanup
// leaves the library in a state that crashes at process exit (HDF5 1.10, found by the disk-full test), while
// our plain write() calls fail cleanly. The price is host memory of about the file's size during a save.
class Writer {
 public:
  Writer(std::string path, std::string tmp) : path_(std::move(path)), tmp_(std::move(tmp)) {}

  Image write(const Archive& a, const Plan& plan) {
    std::string ctx = "archive::save: '" + path_ + "'";
    Id fapl(KILN_H5(H5Pcreate(H5P_FILE_ACCESS), ctx), H5Pclose);
    // The 1.10 format checksums all metadata that locates data: object headers (v2) and the chunk indexes
    // (the 1.8 format's v1 B-tree is unchecksummed: a flipped byte there switched a chunk's filters off and
    // returned wrong values silently). Pinning both bounds keeps files readable by HDF5 >= 1.10 whatever
    // newer library writes them.
    KILN_H5(H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110), ctx);
    KILN_H5(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG), ctx);
    // Grow the in-memory image in steps of the expected file size: usually one allocation.
    size_t expected = size_t(1) << 20;
    for (const auto& [name, t] : a.tensors)
      if (t.defined()) expected += size_t(t.numel()) * t.element_size() + 4096;
    KILN_H5(H5Pset_fapl_core(fapl, std::min<size_t>(expected, size_t(1) << 30), false), ctx);
    H5FD_file_image_callbacks_t callbacks = {ImageMemory::malloc_cb, ImageMemory::memcpy_cb,
                                             ImageMemory::realloc_cb, ImageMemory::free_cb,
                                             ImageMemory::udata_copy_cb, ImageMemory::udata_free_cb, &memory_};
    KILN_H5(H5Pset_file_image_callbacks(fapl, &callbacks), ctx);
    Id fcpl(KILN_H5(H5Pcreate(H5P_FILE_CREATE), ctx), H5Pclose);
    KILN_H5(H5Pset_link_creation_order(fcpl, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED), ctx);
    KILN_H5(H5Pset_obj_track_times(fcpl, false), ctx);
    gcpl_ = Id(KILN_H5(H5Pcreate(H5P_GROUP_CREATE), ctx), H5Pclose);
    KILN_H5(H5Pset_link_creation_order(gcpl_, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED), ctx);
    // No timestamps: saving the same archive twice gives identical bytes.
    KILN_H5(H5Pset_obj_track_times(gcpl_, false), ctx);

    file_ = Id(KILN_H5(H5Fcreate(tmp_.c_str(), H5F_ACC_TRUNC, fcpl, fapl), ctx, ": creating the file in memory"),
               H5Fclose);
    write_attribute(file_, kFormatVersionKey, Attribute(kFormatVersion), ctx);

    NoGradGuard no_grad;  // device and layout copies below are not part of any graph
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      const auto& parts = plan.tensor_parts[i];
      hid_t g = group(parts, parts.size() - 1, ctx);
      write_tensor(g, parts.back(), a.tensors[i].first, a.tensors[i].second);
    }
    size_t i = 0;
    for (const auto& [key, value] : a.attributes) {
      const auto& [gparts, name] = plan.attribute_parts[i++];
      if (gparts.empty() && name == kFormatVersionKey) continue;  // save() always writes the current version
      write_attribute(group(gparts, gparts.size(), ctx), name, value, ctx + ": attribute '" + key + "'");
    }

    for (auto it = groups_.rbegin(); it != groups_.rend(); ++it)
      KILN_H5(it->second.close(), ctx, ": closing group ", it->first);
    groups_.clear();
    KILN_H5(H5Fflush(file_, H5F_SCOPE_GLOBAL), ctx, ": flushing the file");
    // With a null buffer this only reports the file's size (its end of allocation), copying nothing; the
    // memory block is larger (it grows in whole increments).
    ssize_t size = KILN_H5(H5Fget_file_image(file_, nullptr, 0), ctx, ": sizing the file image");
    KILN_H5(H5Fclose(file_.release()), ctx, ": closing the file");
    KILN_CHECK(memory_.data != nullptr, ctx, ": HDF5 left no file image");
    Image image;
    image.data.reset(static_cast<unsigned char*>(memory_.data));
    memory_.data = nullptr;
    image.size = size_t(size);
    return image;
  }

 private:
  // The group made of the first n components, created (with creation order tracked) on first use.
  hid_t group(const std::vector<std::string>& parts, size_t n, const std::string& ctx) {
    hid_t parent = file_;
    std::string path;
    for (size_t i = 0; i < n; ++i) {
      path += "/" + parts[i];
      auto it = groups_.find(path);
      if (it == groups_.end()) {
        Id g(KILN_H5(H5Gcreate2(parent, parts[i].c_str(), H5P_DEFAULT, gcpl_, H5P_DEFAULT), ctx,
                     ": creating group ", path),
             H5Gclose);
        it = groups_.emplace(path, std::move(g)).first;
      }
      parent = it->second;
    }
    return parent;
  }

  void write_tensor(hid_t group, const std::string& leaf, const std::string& name, const Tensor& tensor) {
    std::string ctx = "archive::save: '" + path_ + "': tensor '" + name + "' (" + tensor.str() + ")";
    Tensor t = tensor.detach().to(Device::cpu()).contiguous();
    const Shape& shape = t.shape();
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    Id space(shape.empty() ? KILN_H5(H5Screate(H5S_SCALAR), ctx)
                           : KILN_H5(H5Screate_simple(int(dims.size()), dims.data(), nullptr), ctx),
             H5Sclose);
    Id dcpl(KILN_H5(H5Pcreate(H5P_DATASET_CREATE), ctx), H5Pclose);
    KILN_H5(H5Pset_obj_track_times(dcpl, false), ctx);
    if (!shape.empty() && t.numel() > 0) {
      // Fletcher-32 checksums need chunked storage; chunks of at most ~16 MiB keep HDF5's chunk limit (4 GiB)
      // and memory use of the filter small. Scalars and empty tensors stay contiguous (nothing to protect).
      std::vector<hsize_t> chunk = chunk_dims(dims, t.element_size());
      KILN_H5(H5Pset_chunk(dcpl, int(chunk.size()), chunk.data()), ctx);
      KILN_H5(H5Pset_fletcher32(dcpl), ctx);
    }
    Id type = file_type(t.dtype(), ctx);
    Id ds(KILN_H5(H5Dcreate2(group, leaf.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), ctx,
                  ": creating dataset ", hdf5_path(name)),
          H5Dclose);
    if (t.numel() > 0) KILN_H5(H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw_data()), ctx, ": writing data");
    write_attribute(ds, "dtype", Attribute(std::string(dtype_name(t.dtype()))), ctx);
    write_attribute(ds, "name", Attribute(name), ctx);
    KILN_H5(ds.close(), ctx, ": closing dataset ", hdf5_path(name));
  }

  static std::vector<hsize_t> chunk_dims(const std::vector<hsize_t>& dims, size_t esize) {
    constexpr hsize_t kTarget = hsize_t(16) << 20;
    std::vector<hsize_t> chunk = dims;
    for (size_t d = 0; d < chunk.size(); ++d) {
      hsize_t inner = esize;  // bytes of one step along dim d
      for (size_t e = d + 1; e < chunk.size(); ++e) inner *= chunk[e];
      if (chunk[d] * inner <= kTarget) break;
      chunk[d] = std::max<hsize_t>(1, kTarget / inner);
      if (inner <= kTarget) break;
    }
    return chunk;
  }

  void write_attribute(hid_t obj, const std::string& name, const Attribute& value, const std::string& ctx) {
    std::string what = ctx + ": writing attribute '" + name + "'";
    if (const auto* s = std::get_if<std::string>(&value)) {
      Id type = string_type(std::max<size_t>(s->size(), 1), what);  // HDF5 has no 0-byte strings: "" is one NUL
      Id space(KILN_H5(H5Screate(H5S_SCALAR), what), H5Sclose);
      Id attr(KILN_H5(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), what), H5Aclose);
      std::string padded = *s;
      padded.resize(std::max<size_t>(s->size(), 1), '\0');
      KILN_H5(H5Awrite(attr, type, padded.data()), what);
      KILN_H5(attr.close(), what);
      return;
    }
    // Numbers: scalars get a scalar dataspace, lists a 1-D one (a null dataspace when empty, so the
    // element type, and with it int list vs double list, survives).
    bool is_int = std::holds_alternative<int64_t>(value) || std::holds_alternative<std::vector<int64_t>>(value);
    hid_t file_t = is_int ? H5T_STD_I64LE : H5T_IEEE_F64LE;
    hid_t mem_t = is_int ? H5T_NATIVE_INT64 : H5T_NATIVE_DOUBLE;
    const void* data = nullptr;
    hsize_t n = 1;
    bool scalar = true;
    std::visit(
        [&](const auto& v) {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, int64_t> || std::is_same_v<V, double>) {
            data = &v;
          } else if constexpr (!std::is_same_v<V, std::string>) {
            data = v.data();
            n = v.size();
            scalar = false;
          }
        },
        value);
    Id space(scalar ? KILN_H5(H5Screate(H5S_SCALAR), what)
             : n == 0 ? KILN_H5(H5Screate(H5S_NULL), what)
                      : KILN_H5(H5Screate_simple(1, &n, nullptr), what),
             H5Sclose);
    Id attr(KILN_H5(H5Acreate2(obj, name.c_str(), file_t, space, H5P_DEFAULT, H5P_DEFAULT), what), H5Aclose);
    if (scalar || n > 0) KILN_H5(H5Awrite(attr, mem_t, data), what);
    KILN_H5(attr.close(), what);
  }

  std::string path_, tmp_;
  ImageMemory memory_;  // before file_: the file is closed (releasing into memory_) before memory_ goes
  Id file_, gcpl_;
  std::map<std::string, Id> groups_;
};

// Writes `data` to a new file at `path` and makes it durable (fsync) before the caller publishes it.
void write_durably(const std::string& path, const Image& image, const std::string& ctx) {
  const unsigned char* data = image.data.get();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  KILN_CHECK(fd >= 0, ctx, ": cannot create the temporary file '", path, "': ", std::strerror(errno),
             " (does the directory exist and is it writable?)");
  size_t done = 0;
  while (done < image.size) {
    ssize_t n = ::write(fd, data + done, std::min<size_t>(image.size - done, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      ::close(fd);
      KILN_FAIL(ctx, ": writing '", path, "' failed after ", done, " of ", image.size, " bytes: ", std::strerror(err));
    }
    done += size_t(n);
  }
  int rc = ::fsync(fd);
  int err = errno;
  if (rc != 0) {
    ::close(fd);
    KILN_FAIL(ctx, ": fsync of '", path, "' failed: ", std::strerror(err));
  }
  // close() can report a deferred write error (NFS).
  KILN_CHECK(::close(fd) == 0, ctx, ": closing '", path, "' failed: ", std::strerror(errno));
}

// Persists a rename by syncing the directory. Best effort: some filesystems cannot sync directories, and the
// data are already durable.
void sync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// ---- reading ----

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)), ctx_("archive::load: '" + path_ + "'") {}

  Archive read() {
    namespace fs = std::filesystem;
    std::error_code ec;
    bool exists = fs::exists(path_, ec);
    KILN_CHECK(exists, ctx_, ": ", ec ? ec.message() : std::string("no such file"));
    KILN_CHECK(!fs::is_directory(path_, ec), ctx_, ": is a directory, not an archive file");
    htri_t is_h5 = H5Fis_hdf5(path_.c_str());
    if (is_h5 < 0) KILN_FAIL(ctx_, ": cannot read the file [", h5_detail(), "]");
    KILN_CHECK(is_h5 > 0, ctx_, ": not an HDF5 file (no HDF5 signature: wrong file, or overwritten with other data)");

    Id fapl(KILN_H5(H5Pcreate(H5P_FILE_ACCESS), ctx_), H5Pclose);
    KILN_H5(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG), ctx_);
#if H5_VERSION_GE(1, 10, 7)
    KILN_H5(H5Pset_file_locking(fapl, true, true), ctx_);
#endif
    Id file(KILN_H5(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, fapl), ctx_,
                    ": cannot open as an HDF5 file (truncated or corrupted?)"),
            H5Fclose);
    Id root(KILN_H5(H5Gopen2(file, "/", H5P_DEFAULT), ctx_, ": opening the root group"), H5Gclose);

    // The version first: a newer layout may not make sense to the checks below.
    htri_t has_version = KILN_H5(H5Aexists(root, kFormatVersionKey), ctx_, ": reading the root attributes");
    KILN_CHECK(has_version > 0, ctx_, ": not a Kiln archive (the root attribute '", kFormatVersionKey,
               "' is missing)");
    Attribute v = read_attribute(root, kFormatVersionKey, ctx_ + ": root attribute '" + kFormatVersionKey + "'");
    const int64_t* version = std::get_if<int64_t>(&v);
    KILN_CHECK(version != nullptr, ctx_, ": root attribute '", kFormatVersionKey, "' has type ",
               attribute_type_name(v), ", expected an int");
    KILN_CHECK(*version >= 1 && *version <= kFormatVersion, ctx_, ": format version ", *version,
               " is not supported (this build reads versions 1 to ", kFormatVersion, ")");

    Archive a;
    a.source = path_;
    visit(root, {}, a);
    root.reset();
    KILN_H5(H5Fclose(file.release()), ctx_, ": closing the file");
    return a;
  }

 private:
  static constexpr int kMaxDepth = 64;          // deeper nesting only arises from link cycles
  static constexpr size_t kMaxObjects = 1u << 24;  // bounds the walk of a malicious or corrupted file

  // Reads a group's attributes and, recursively, its groups and datasets. `parts` is the group's path.
  void visit(hid_t group, const std::vector<std::string>& parts, Archive& a) {
    std::string gpath = join(parts, parts.size());
    KILN_CHECK(int(parts.size()) <= kMaxDepth, ctx_, ": groups nested deeper than ", kMaxDepth, " at ", gpath,
               " (corrupted file or a link cycle)");
    std::string prefix;
    for (const std::string& p : parts) prefix += p + "/";
    for (const std::string& name : attribute_names(group, gpath))
      a.attributes[prefix + name] = read_attribute(group, name, ctx_ + ": attribute '" + name + "' of group " + gpath);

    std::string ctx = ctx_ + ": group " + gpath;
    H5G_info_t info;
    KILN_H5(H5Gget_info(group, &info), ctx);
    // Files Kiln writes track creation order, so tensors come back in the order they were saved.
    Id gcpl(KILN_H5(H5Gget_create_plist(group), ctx), H5Pclose);
    unsigned order_flags = 0;
    KILN_H5(H5Pget_link_creation_order(gcpl, &order_flags), ctx);
    H5_index_t index = (order_flags & H5P_CRT_ORDER_INDEXED) ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME;
    for (hsize_t i = 0; i < info.nlinks; ++i) {
      KILN_CHECK(++objects_ <= kMaxObjects, ctx_, ": more than ", kMaxObjects, " objects (corrupted file?)");
      ssize_t len = KILN_H5(H5Lget_name_by_idx(group, ".", index, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT), ctx,
                            ": reading link ", i);
      std::string name(size_t(len), '\0');
      KILN_H5(H5Lget_name_by_idx(group, ".", index, H5_ITER_INC, i, name.data(), size_t(len) + 1, H5P_DEFAULT), ctx,
              ": reading link ", i);
      std::string child = gpath == "/" ? "/" + name : gpath + "/" + name;
      Id obj(KILN_H5(H5Oopen(group, name.c_str(), H5P_DEFAULT), ctx_, ": opening ", child), H5Oclose);
      H5I_type_t type = KILN_H5(H5Iget_type(obj), ctx_, ": ", child);
      if (type == H5I_GROUP) {
        std::vector<std::string> sub = parts;
        sub.push_back(name);
        visit(obj, sub, a);
      } else if (type == H5I_DATASET) {
        read_dataset(obj, child, a);
      }
      // Committed datatypes carry no tensor data; other readers' extras are ignored.
    }
  }

  static herr_t collect_name(hid_t, const char* name, const H5A_info_t*, void* data) {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
    return 0;
  }

  std::vector<std::string> attribute_names(hid_t obj, const std::string& what) {
    std::vector<std::string> names;
    hsize_t idx = 0;
    KILN_H5(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, &idx, collect_name, &names), ctx_, ": listing attributes of ",
            what);
    return names;
  }

  Attribute read_attribute(hid_t obj, const std::string& name, const std::string& ctx) {
    Id attr(KILN_H5(H5Aopen(obj, name.c_str(), H5P_DEFAULT), ctx), H5Aclose);
    Id type(KILN_H5(H5Aget_type(attr), ctx), H5Tclose);
    Id space(KILN_H5(H5Aget_space(attr), ctx), H5Sclose);
    H5S_class_t sclass = KILN_H5(H5Sget_simple_extent_type(space), ctx);
    hssize_t n = sclass == H5S_NULL ? 0 : KILN_H5(H5Sget_simple_extent_npoints(space), ctx);
    H5T_class_t cls = KILN_H5(H5Tget_class(type), ctx);

    if (cls == H5T_STRING) {
      KILN_CHECK(sclass == H5S_SCALAR, ctx, ": string lists are not supported");
      htri_t var = KILN_H5(H5Tis_variable_str(type), ctx);
      if (var) {
        Id mem = string_type(0, ctx);
        char* p = nullptr;
        KILN_H5(H5Aread(attr, mem, &p), ctx);
        std::string s = p ? p : "";
        H5free_memory(p);
        return s;
      }
      size_t size = H5Tget_size(type);
      KILN_CHECK(size > 0, ctx, ": cannot get the string size [", h5_detail(), "]");
      std::string s(size, '\0');
      KILN_H5(H5Aread(attr, type, s.data()), ctx);
      return s.substr(0, s.find('\0'));  // fixed-length strings are NUL- or space-padded
    }
    KILN_CHECK(cls == H5T_INTEGER || cls == H5T_FLOAT, ctx, ": unsupported attribute type (", type_description(type),
               "); Kiln attributes are ints, doubles, strings and lists of ints or doubles");
    KILN_CHECK(n <= (hssize_t(1) << 28), ctx, ": ", n, " elements is too large for an attribute (corrupted file?)");
    auto read_values = [&](auto zero, hid_t mem) {
      std::vector<decltype(zero)> v(size_t(n), zero);
      if (n > 0) KILN_H5(H5Aread(attr, mem, v.data()), ctx);
      return v;
    };
    if (cls == H5T_INTEGER) {
      auto v = read_values(int64_t(0), H5T_NATIVE_INT64);
      if (sclass == H5S_SCALAR) return v.at(0);
      return v;
    }
    auto v = read_values(0.0, H5T_NATIVE_DOUBLE);
    if (sclass == H5S_SCALAR) return v.at(0);
    return v;
  }

  void read_dataset(hid_t ds, const std::string& h5path, Archive& a) {
    std::string ctx = ctx_ + ": dataset " + h5path;
    htri_t has_dtype = KILN_H5(H5Aexists(ds, "dtype"), ctx);
    KILN_CHECK(has_dtype > 0, ctx, " has no 'dtype' attribute (Kiln writes one on every tensor)");
    Attribute dtype_attr = read_attribute(ds, "dtype", ctx + ": attribute 'dtype'");
    const std::string* dtype_name_p = std::get_if<std::string>(&dtype_attr);
    KILN_CHECK(dtype_name_p != nullptr, ctx, ": attribute 'dtype' has type ", attribute_type_name(dtype_attr),
               ", expected a string");
    DType dt;
    try {
      dt = dtype_from_name(*dtype_name_p);
    } catch (const Error&) {
      KILN_FAIL(ctx, ": unknown dtype '", *dtype_name_p, "'");
    }

    // The tensor's name: stored verbatim by save(); it must agree with where the dataset sits.
    std::string name = h5path.substr(1);
    htri_t has_name = KILN_H5(H5Aexists(ds, "name"), ctx);
    if (has_name > 0) {
      Attribute n = read_attribute(ds, "name", ctx + ": attribute 'name'");
      const std::string* s = std::get_if<std::string>(&n);
      KILN_CHECK(s != nullptr, ctx, ": attribute 'name' has type ", attribute_type_name(n), ", expected a string");
      std::string mapped;
      try {
        mapped = hdf5_path(*s);
      } catch (const Error&) {
        KILN_FAIL(ctx, ": attribute 'name' holds an invalid tensor name '", *s, "'");
      }
      KILN_CHECK(mapped == h5path, ctx, ": attribute 'name' says '", *s, "', which belongs at ", mapped,
                 " (corrupted file?)");
      name = *s;
    }
    KILN_CHECK(a.find(name) == nullptr, ctx, ": a second tensor named '", name, "'");

    Id type(KILN_H5(H5Dget_type(ds), ctx), H5Tclose);
    KILN_CHECK(type_matches(type, dt, ctx), ctx, ": attribute 'dtype' says ", dtype_name(dt),
               " but the data are stored as ", type_description(type));

    Id space(KILN_H5(H5Dget_space(ds), ctx), H5Sclose);
    H5S_class_t sclass = KILN_H5(H5Sget_simple_extent_type(space), ctx);
    KILN_CHECK(sclass != H5S_NULL, ctx, ": has a null dataspace (no shape)");
    Shape shape;
    if (sclass == H5S_SIMPLE) {
      int rank = KILN_H5(H5Sget_simple_extent_ndims(space), ctx);
      std::vector<hsize_t> dims(static_cast<size_t>(rank));
      KILN_H5(H5Sget_simple_extent_dims(space, dims.data(), nullptr), ctx);
      int64_t numel = 1;
      for (hsize_t d : dims) {
        KILN_CHECK(d <= hsize_t(std::numeric_limits<int64_t>::max()), ctx, ": dimension ", d, " is too large");
        KILN_CHECK(d == 0 || numel <= std::numeric_limits<int64_t>::max() / int64_t(d), ctx,
                   ": shape overflows 64-bit sizes (corrupted file?)");
        numel *= int64_t(d);
        shape.push_back(int64_t(d));
      }
    }

    Tensor t;
    try {
      t = empty(shape, {.dtype = dt});
    } catch (const std::bad_alloc&) {
      KILN_FAIL(ctx, ": cannot allocate ", dtype_name(dt), shape_str(shape), " (corrupted file?)");
    }
    if (t.numel() > 0) {
      Id mem = file_type(dt, ctx);
      KILN_H5(H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw_data()), ctx,
              ": reading data (truncated or corrupted?)");
      if (dt == DType::boolean) {
        // Any byte other than 0/1 is not a valid C++ bool; normalise instead of passing UB along.
        auto* b = static_cast<uint8_t*>(t.raw_data());
        for (int64_t i = 0; i < t.numel(); ++i) b[i] = b[i] != 0;
      }
    }
    a.tensors.emplace_back(std::move(name), std::move(t));
  }

  std::string path_, ctx_;
  size_t objects_ = 0;
};

}  // namespace

namespace {

// This host's name, so that a temporary's owner is known on a shared file system.
std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "host";
  std::string h(buf);
  std::replace(h.begin(), h.end(), '.', '_');  // the name's fields are split on '.'
  return h;
}

// `path`.tmp.<host>.<pid>.<n>: unique per call, so threads and processes (ranks) that save to one path
// never share a temporary file; each rename then installs one complete file.
std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + host_name() + "." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

// Temporaries left by processes of this host that died mid-save (SIGKILL, power loss) are removed by the
// next save to the same path. A process that is alive keeps its temporary; other hosts' are left alone.
void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string prefix = target.filename().string() + ".tmp." + host_name() + ".";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // <pid>.<n>
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0 || rest.find_first_not_of("0123456789.") != std::string::npos) continue;
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove(it->path(), ec);
  }
}

}  // namespace

void save(const std::string& path, const Archive& archive) {
  std::string ctx = "archive::save: '" + path + "'";
  Plan plan = plan_layout(path, archive);
  std::error_code ec;
  KILN_CHECK(!std::filesystem::is_directory(path, ec), ctx, ": is a directory");
  remove_stale_temporaries(path);
  const std::string tmp = temporary_name(path);
  Image image;
  {
    Session session;  // HDF5 is used only in here, including the Writer's destructor
    image = Writer(path, tmp).write(archive, plan);
  }
  try {
    write_durably(tmp, image, ctx);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  image.data.reset();  // release the memory before the rename
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    KILN_FAIL(ctx, ": cannot rename '", tmp, "' to it: ", std::strerror(err));
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  sync_directory(dir.empty() ? std::string(".") : dir.string());
}

Archive load(const std::string& path) {
  Session session;
  try {
    return Reader(path).read();
  } catch (const std::bad_alloc&) {
    KILN_FAIL("archive::load: '", path, "': out of memory while reading (corrupted file?)");
  }
}

}  // namespace kiln::archive
