// Fashion-MNIST and the idx file format it ships in.
//
// idx (LeCun's MNIST format): a 4-byte magic number 0x00 0x00 <type> <ndims>, then ndims big-endian uint32
// dimensions, then the values, row-major. Type 0x08 is unsigned byte; images are idx3 (N, rows, cols), labels
// idx1 (N). The files are distributed gzip-compressed; zlib's gzread reads compressed and plain files alike.
#include <kiln/core/data/data.h>

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace kiln::data {

namespace {

// Closes a gzFile on every path out of read_idx.
struct GzFile {
  gzFile f = nullptr;
  ~GzFile() {
    if (f) gzclose(f);
  }
};

// Reads exactly `n` bytes unless the stream ends; returns how many were read. Throws on a zlib error.
size_t read_fully(gzFile f, uint8_t* dst, size_t n, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    unsigned chunk = unsigned(std::min<size_t>(n - done, size_t(1) << 30));
    int got = gzread(f, dst + done, chunk);
    if (got < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      KILN_FAIL("read_idx: '", path, "': ", code == Z_ERRNO ? std::strerror(errno) : msg,
                " (damaged gzip stream?)");
    }
    if (got == 0) break;
    done += size_t(got);
  }
  // gzread reports some errors (a bad CRC, a cut-off stream) only through gzerror after returning short.
  int code = Z_OK;
  const char* msg = gzerror(f, &code);
  KILN_CHECK(code == Z_OK || code == Z_STREAM_END, "read_idx: '", path, "': ", msg, " (damaged gzip stream?)");
  return done;
}

std::string hex_bytes(const uint8_t (&b)[4]) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%02x%02x%02x%02x", b[0], b[1], b[2], b[3]);
  return buf;
}

// `<root>/<name>.gz`, or `<root>/<name>` when only the uncompressed file is there.
std::string locate(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  fs::path gz = fs::path(root) / (name + ".gz"), plain = fs::path(root) / name;
  std::error_code ec;
  if (fs::exists(gz, ec) || !fs::exists(plain, ec)) return gz.string();  // a missing file is reported by read_idx
  return plain.string();
}

}  // namespace

IdxData read_idx(const std::string& path, int expected_ndims) {
  std::error_code ec;
  KILN_CHECK(std::filesystem::exists(path, ec), "read_idx: '", path,
             "': no such file (Fashion-MNIST on Debian: apt install dataset-fashion-mnist)");
  KILN_CHECK(!std::filesystem::is_directory(path, ec), "read_idx: '", path, "' is a directory");
  GzFile f;
  f.f = gzopen(path.c_str(), "rb");
  KILN_CHECK(f.f != nullptr, "read_idx: cannot open '", path, "': ", std::strerror(errno));
  gzbuffer(f.f, 1 << 20);

  uint8_t magic[4];
  KILN_CHECK(read_fully(f.f, magic, 4, path) == 4, "read_idx: '", path, "' is too short for an idx header");
  KILN_CHECK(magic[0] == 0 && magic[1] == 0 && magic[2] == 0x08, "read_idx: '", path, "': bad magic number ",
             hex_bytes(magic), " (expected 0x0000080", expected_ndims, ": unsigned bytes in ", expected_ndims,
             " dimensions; not an idx file, or a damaged one)");
  KILN_CHECK(magic[3] == expected_ndims, "read_idx: '", path, "' has ", int(magic[3]), " dimensions, expected ",
             expected_ndims, " (images are idx3, labels idx1: are the files swapped?)");

  IdxData out;
  uint64_t total = 1;
  for (int d = 0; d < expected_ndims; ++d) {
    uint8_t b[4];
    KILN_CHECK(read_fully(f.f, b, 4, path) == 4, "read_idx: '", path, "': header cut off in dimension ", d);
    uint32_t n = uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | b[3];  // big-endian
    out.dims.push_back(int64_t(n));
    total *= n;
    // A corrupted header must not ask for terabytes before the read finds out.
    KILN_CHECK(total <= (uint64_t(1) << 34), "read_idx: '", path, "': header claims ", shape_str(out.dims),
               " values, implausibly many (damaged file?)");
  }

  // Grow with the data actually read, so a header that lies costs no huge allocation.
  constexpr size_t kStep = size_t(16) << 20;
  size_t got = 0;
  while (got < total) {
    size_t want = std::min<size_t>(size_t(total) - got, kStep);
    out.values.resize(got + want);
    size_t n = read_fully(f.f, out.values.data() + got, want, path);
    got += n;
    if (n < want) break;
  }
  KILN_CHECK(got == total, "read_idx: '", path, "' is truncated: the header ", shape_str(out.dims), " promises ",
             total, " bytes of data, the file has ", got);
  uint8_t extra;
  KILN_CHECK(read_fully(f.f, &extra, 1, path) == 0, "read_idx: '", path, "' has bytes after the ", total,
             " the header promises (damaged file, or a different format?)");
  int rc = gzclose(f.f);
  f.f = nullptr;
  KILN_CHECK(rc == Z_OK, "read_idx: '", path, "': closing failed (zlib code ", rc, ")");
  return out;
}

FashionMNIST::FashionMNIST(const std::string& root, Split split, FashionMNISTOptions options) {
  std::string prefix = split == Split::Train ? "train" : "t10k";
  std::string images_path = locate(root, prefix + "-images-idx3-ubyte");
  std::string labels_path = locate(root, prefix + "-labels-idx1-ubyte");
  IdxData images = read_idx(images_path, 3);
  IdxData labels = read_idx(labels_path, 1);
  KILN_CHECK(images.dims[0] == labels.dims[0], "FashionMNIST: '", images_path, "' holds ", images.dims[0],
             " images but '", labels_path, "' holds ", labels.dims[0], " labels");
  KILN_CHECK(images.dims[1] > 0 && images.dims[2] > 0, "FashionMNIST: '", images_path, "' has empty images ",
             shape_str(images.dims));
  for (size_t i = 0; i < labels.values.size(); ++i)
    KILN_CHECK(labels.values[i] < kClasses, "FashionMNIST: '", labels_path, "': label ", int(labels.values[i]),
               " of example ", i, " is not a class 0..", kClasses - 1);
  KILN_CHECK(!options.normalize || options.std > 0, "FashionMNIST: normalization std must be positive, got ",
             options.std);
  size_ = images.dims[0];
  rows_ = images.dims[1];
  cols_ = images.dims[2];
  pixels_ = std::move(images.values);
  labels_ = std::move(labels.values);
  for (int v = 0; v < 256; ++v) {
    double x = v / 255.0;
    if (options.normalize) x = (x - options.mean) / options.std;
    pixel_value_[size_t(v)] = float(x);
  }
}

int64_t FashionMNIST::label(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size_, "FashionMNIST: index ", index, " out of range for ", size_, " examples");
  return labels_[size_t(index)];
}

Batch FashionMNIST::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t b = int64_t(indices.size()), pixels = rows_ * cols_;
  Tensor x = empty({b, 1, rows_, cols_});
  Tensor y = empty({b}, {.dtype = DType::i64});
  float* xp = x.data_ptr<float>();
  int64_t* yp = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    int64_t idx = indices[size_t(i)];
    KILN_CHECK(idx >= 0 && idx < size_, "FashionMNIST: index ", idx, " out of range for ", size_, " examples");
    const uint8_t* src = pixels_.data() + idx * pixels;
    float* dst = xp + i * pixels;
    for (int64_t p = 0; p < pixels; ++p) dst[p] = pixel_value_[src[p]];
    yp[i] = labels_[size_t(idx)];
  }
  return {x, y};
}

const char* FashionMNIST::class_name(int64_t label) {
  static const char* const names[kClasses] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                              "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  KILN_CHECK(label >= 0 && label < kClasses, "FashionMNIST::class_name: label ", label, " is not in 0..9");
  return names[label];
}

}  // namespace kiln::data
