// The in-memory side of the tensor archive: names, lookups, typed attribute getters and the
// check-then-copy that restores tensors into a model. The HDF5 side is core/archive/h5.cpp.
#include <kiln/core/archive/archive.h>

#include <algorithm>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <kiln/autograd/grad_mode.h>

namespace kiln::archive {

namespace {

// '.' and '/' name the same thing; comparing canonical spellings makes lookups spelling-blind.
std::string canonical(std::string name) {
  std::replace(name.begin(), name.end(), '.', '/');
  return name;
}

std::string where(const Archive& a) { return a.source.empty() ? std::string("archive") : "archive '" + a.source + "'"; }

// "an int", "a double list": attribute type names with their article, for messages.
std::string with_article(const char* type) {
  return (std::string("aeiou").find(type[0]) != std::string::npos ? "an " : "a ") + std::string(type);
}

std::string describe(const Shape& shape, DType dtype) { return std::string(dtype_name(dtype)) + shape_str(shape); }

// Canonical namespace prefix with a trailing '/', or "" for the whole archive.
std::string canonical_prefix(const std::string& prefix) {
  std::string p = canonical(prefix);
  if (!p.empty() && p.back() != '/') p += '/';
  return p;
}

}  // namespace

const char* attribute_type_name(const Attribute& a) {
  switch (a.index()) {
    case 0: return "int";
    case 1: return "double";
    case 2: return "string";
    case 3: return "int list";
    case 4: return "double list";
  }
  return "?";
}

std::vector<std::string> split_tensor_name(const std::string& name) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : name) {
    KILN_CHECK(c != '\0', "archive: tensor name '", name, "' contains a NUL byte");
    if (c == '/' || c == '.') {
      KILN_CHECK(!cur.empty(), "archive: tensor name '", name, "' has an empty component (separators are '/' and '.')");
      parts.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  KILN_CHECK(!cur.empty(), "archive: tensor name '", name, "' is empty or ends with a separator");
  parts.push_back(std::move(cur));
  return parts;
}

std::string hdf5_path(const std::string& tensor_name) {
  std::string path;
  for (const std::string& p : split_tensor_name(tensor_name)) path += "/" + p;
  return path;
}

std::pair<std::vector<std::string>, std::string> split_attribute_key(const std::string& key) {
  KILN_CHECK(!key.empty(), "archive: empty attribute key");
  KILN_CHECK(key.find('\0') == std::string::npos, "archive: attribute key '", key, "' contains a NUL byte");
  std::vector<std::string> groups;
  size_t start = 0;
  for (size_t slash; (slash = key.find('/', start)) != std::string::npos; start = slash + 1) {
    std::string g = key.substr(start, slash - start);
    KILN_CHECK(!g.empty(), "archive: attribute key '", key, "' has an empty group component");
    // Tensor groups never contain dots; allowing them here would create groups no tensor name can reach.
    KILN_CHECK(g.find('.') == std::string::npos, "archive: attribute key '", key,
               "': group components may not contain '.' (use '/' to separate groups)");
    groups.push_back(std::move(g));
  }
  std::string name = key.substr(start);
  KILN_CHECK(!name.empty(), "archive: attribute key '", key, "' ends with '/'");
  return {std::move(groups), std::move(name)};
}

void Archive::add(const std::string& name, const Tensor& t) {
  split_tensor_name(name);  // validates
  KILN_CHECK(t.defined(), where(*this), ": add: tensor '", name, "' is undefined");
  KILN_CHECK(find(name) == nullptr, where(*this), ": add: duplicate tensor name '", name, "'");
  // A tensor is a dataset and every separator a group: a name that is the group of another tensor (or of
  // an attribute) could never be saved. Say so here, not at save().
  const std::string mine = canonical(name);
  for (const auto& [n, other] : tensors) {
    const std::string theirs = canonical(n);
    KILN_CHECK(theirs.rfind(mine + "/", 0) != 0 && mine.rfind(theirs + "/", 0) != 0, where(*this), ": add: tensor name '",
               name, "' clashes with tensor '", n, "': one would be a group holding the other");
  }
  for (const auto& [key, value] : attributes)
    KILN_CHECK(key.rfind(mine + "/", 0) != 0, where(*this), ": add: tensor name '", name, "' clashes with attribute '",
               key, "', which makes it a group");
  tensors.emplace_back(name, t);
}

const Tensor* Archive::find(const std::string& name) const {
  std::string want = canonical(name);
  for (const auto& [n, t] : tensors)
    if (canonical(n) == want) return &t;
  return nullptr;
}

const Tensor& Archive::tensor(const std::string& name) const {
  const Tensor* t = find(name);
  if (t) return *t;
  std::ostringstream os;
  os << where(*this) << ": no tensor '" << name << "' (it holds " << tensors.size() << " tensors";
  for (size_t i = 0; i < tensors.size() && i < 8; ++i) os << (i ? ", " : ": ") << tensors[i].first;
  if (tensors.size() > 8) os << ", ...";
  os << ")";
  KILN_FAIL(os.str());
}

std::vector<std::pair<std::string, Tensor>> Archive::tensors_under(const std::string& prefix) const {
  std::string p = canonical_prefix(prefix);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [n, t] : tensors) {
    // canonical() maps character for character, so the prefix length holds for the original spelling.
    if (canonical(n).compare(0, p.size(), p) == 0 && n.size() > p.size()) out.emplace_back(n.substr(p.size()), t);
  }
  return out;
}

const Attribute& Archive::attribute(const std::string& key) const {
  auto it = attributes.find(key);
  if (it != attributes.end()) return it->second;
  std::ostringstream os;
  os << where(*this) << ": no attribute '" << key << "' (it has";
  if (attributes.empty()) os << " none";
  size_t i = 0;
  for (const auto& [k, v] : attributes) {
    if (i == 12) { os << ", ..."; break; }
    os << (i++ ? ", " : ": ") << k;
  }
  os << ")";
  KILN_FAIL(os.str());
}

void Archive::wrong_type(const std::string& key, const char* expected) const {
  KILN_FAIL(where(*this), ": attribute '", key, "' is ", with_article(attribute_type_name(attributes.at(key))),
            ", expected ", with_article(expected));
}

void check_tensors(const Archive& archive, const std::string& prefix,
                   const std::vector<std::pair<std::string, Tensor>>& expected) {
  std::string p = canonical_prefix(prefix);
  std::unordered_map<std::string, const Tensor*> stored;  // canonical relative name -> tensor
  std::vector<std::pair<std::string, const Tensor*>> stored_order;  // original relative spelling
  for (const auto& [n, t] : archive.tensors) {
    std::string c = canonical(n);
    if (c.size() <= p.size() || c.compare(0, p.size(), p) != 0) continue;
    stored[c.substr(p.size())] = &t;
    stored_order.emplace_back(n.substr(p.size()), &t);
  }

  std::vector<std::string> problems;
  std::unordered_set<std::string> wanted;
  for (const auto& [n, t] : expected) {
    KILN_CHECK(t.defined(), where(archive), ": check_tensors: expected tensor '", n, "' is undefined");
    std::string c = canonical(n);
    wanted.insert(c);
    auto it = stored.find(c);
    if (it == stored.end()) {
      problems.push_back("missing " + p + n + " (expected " + describe(t.shape(), t.dtype()) + ")");
      continue;
    }
    const Tensor& s = *it->second;
    if (s.shape() != t.shape() || s.dtype() != t.dtype())
      problems.push_back((s.shape() != t.shape() ? "shape mismatch " : "dtype mismatch ") + p + n + ": file has " +
                         describe(s.shape(), s.dtype()) + ", expected " + describe(t.shape(), t.dtype()));
  }
  for (const auto& [n, s] : stored_order)
    if (!wanted.count(canonical(n)))
      problems.push_back("unexpected " + p + n + " (" + describe(s->shape(), s->dtype()) + ")");
  if (problems.empty()) return;
  std::ostringstream os;
  os << where(archive) << ": " << problems.size() << (problems.size() == 1 ? " mismatch" : " mismatches");
  if (!p.empty()) os << " under '" << p << "'";
  os << ":";
  for (const std::string& s : problems) os << "\n  " << s;
  KILN_FAIL(os.str());
}

void restore_tensors(const Archive& archive, const std::string& prefix,
                     const std::vector<std::pair<std::string, Tensor>>& targets) {
  check_tensors(archive, prefix, targets);  // throws before any target is written
  std::string p = canonical_prefix(prefix);
  NoGradGuard no_grad;
  for (const auto& [n, t] : targets) {
    Tensor dst = t;  // a handle to the same tensor
    dst.copy_(archive.tensor(p + n));
  }
}

}  // namespace kiln::archive
