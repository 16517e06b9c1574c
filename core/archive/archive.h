#pragma once
// Tensor archive: named tensors and attributes in one HDF5 file that h5dump, h5py or any HDF5 reader can
// open. It is the storage layer under checkpoints (optim/checkpoint.h); docs/checkpoint-format.md
// describes the file layout.
//
// Names. A tensor name is a path whose separators are '/' and '.': "model/fc1.weight" is the dataset
// "weight" in the group /model/fc1. '/' separates namespaces ("model", "optimizer/state"), '.' separates
// module levels as in a state_dict, and both become HDF5 groups, so a checkpoint shows one group per
// module. The exact name is also stored on the dataset (attribute "name"), which makes the mapping
// reversible: load() returns the names that were saved. Lookups treat '.' and '/' alike, so
// tensor("model.fc1.weight") finds "model/fc1.weight".
//
// Attributes. An attribute key "a/b/key" is the attribute "key" on the group /a/b; a key without '/'
// lives on the root group. Only '/' separates groups here (the attribute's own name may contain dots).
// The root attribute "kiln_format_version" is written by save() and checked by load().
//
// Files. save() is atomic: it builds the file in memory, writes it to "<path>.tmp.<pid>", fsyncs it and
// renames it over <path>, so a crash or an error (disk full included) leaves the previous file intact.
// load() reads everything into memory and checks it before returning, so a truncated or corrupted file
// gives a kiln::Error (naming the file and what was being read) and nothing the caller owns has been
// touched. Data are checksummed (Fletcher-32) and the metadata carries HDF5's own checksums, so
// corruption inside the file is detected, not only truncation.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::archive {

// Version of the layout described in docs/checkpoint-format.md. load() refuses files from a newer layout.
inline constexpr int64_t kFormatVersion = 1;
inline constexpr const char* kFormatVersionKey = "kiln_format_version";

// Attribute values. A scalar and a one-element vector are different things and stay different on disk
// (scalar vs 1-D dataspace).
using Attribute = std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>>;
const char* attribute_type_name(const Attribute& a);  // "int", "double", "string", "int list", "double list"

struct Archive {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in save order; load returns them depth-first
  std::map<std::string, Attribute> attributes;
  std::string source;  // the file load() read, for error messages; empty for an archive built in memory

  // Appends a tensor; throws if the name is invalid or already present (in either spelling).
  void add(const std::string& name, const Tensor& t);
  void set(const std::string& key, Attribute value) { attributes[key] = std::move(value); }

  const Tensor* find(const std::string& name) const;  // nullptr when absent
  bool has_tensor(const std::string& name) const { return find(name) != nullptr; }
  const Tensor& tensor(const std::string& name) const;  // throws kiln::Error naming the missing tensor
  // The tensors whose names start with the namespace `prefix` ("model" or "model/"), with it removed:
  // {"fc1.weight", ...}. The names keep their original spelling.
  std::vector<std::pair<std::string, Tensor>> tensors_under(const std::string& prefix) const;

  bool has(const std::string& key) const { return attributes.count(key) != 0; }
  // Typed getters: throw kiln::Error naming the key, the expected type and the stored type.
  int64_t get_int(const std::string& key) const { return get<int64_t>(key); }
  double get_double(const std::string& key) const { return get<double>(key); }
  const std::string& get_string(const std::string& key) const { return get<std::string>(key); }
  const std::vector<int64_t>& get_ints(const std::string& key) const { return get<std::vector<int64_t>>(key); }
  const std::vector<double>& get_doubles(const std::string& key) const { return get<std::vector<double>>(key); }
  template <class T> const T& get(const std::string& key) const;

 private:
  const Attribute& attribute(const std::string& key) const;
  [[noreturn]] void wrong_type(const std::string& key, const char* expected) const;
};

// Writes the archive to `path` atomically (see above). Tensors may live on any device and have any
// strides; they are copied to contiguous CPU memory one at a time. Validates every name before creating
// any file. Throws kiln::Error naming the file on any failure; the temporary file is removed. Needs host
// memory of about the file's size while it runs (the file is built in memory, then written).
void save(const std::string& path, const Archive& archive);

// Reads a whole archive into CPU tensors. Throws kiln::Error naming the file and the object being read on
// a missing, truncated, corrupted or non-Kiln file, an unknown dtype, or a dtype that does not match the
// stored HDF5 type. Never prints HDF5's error stack.
Archive load(const std::string& path);

// Compares the tensors stored under `prefix` with `expected` (names relative to prefix, as a state_dict
// gives them) and throws one kiln::Error that lists every missing tensor, every unexpected tensor and
// every shape or dtype mismatch. Only names, shapes and dtypes of `expected` are used.
void check_tensors(const Archive& archive, const std::string& prefix,
                   const std::vector<std::pair<std::string, Tensor>>& expected);
// check_tensors, then copies every stored tensor into its target (across devices, without recording
// autograd). Either all targets are written or, when something does not match, none is.
void restore_tensors(const Archive& archive, const std::string& prefix,
                     const std::vector<std::pair<std::string, Tensor>>& targets);

// Name mapping, exposed for tools and tests.
// Splits a tensor name at '/' and '.': "model/fc1.weight" -> {"model", "fc1", "weight"}. Throws on an
// empty name or component ("a..b", "/a", "a/").
std::vector<std::string> split_tensor_name(const std::string& name);
// The HDF5 path of a tensor: "model/fc1.weight" -> "/model/fc1/weight".
std::string hdf5_path(const std::string& tensor_name);
// Splits an attribute key into its group components and its name: "optimizer/lr" -> {{"optimizer"}, "lr"}.
// Throws on empty components or dots in group components.
std::pair<std::vector<std::string>, std::string> split_attribute_key(const std::string& key);

// ---- implementation ----
template <class T>
const T& Archive::get(const std::string& key) const {
  const Attribute& a = attribute(key);
  if (const T* v = std::get_if<T>(&a)) return *v;
  Attribute probe = T{};
  wrong_type(key, attribute_type_name(probe));
}

}  // namespace kiln::archive
