// Files written by other HDF5 writers (here: the HDF5 C API directly, as h5py would): what load() accepts,
// what it rejects and how it says so; and the layout save() produces, seen through the C API.
#include <hdf5.h>

#include "test_util.h"

namespace kiln::archive::test {
namespace {


// A minimal writer for test files; every call is checked with ASSERT-like failures.
class RawFile {
 public:
  explicit RawFile(const std::string& path) { file_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT); }
  ~RawFile() { H5Fclose(file_); }
  hid_t id() const { return file_; }
  bool ok() const { return file_ >= 0; }

  void version(int64_t v) { attr_i64(file_, "kiln_format_version", v); }
  hid_t dataset(const std::string& name, hid_t type, const std::vector<hsize_t>& dims, const void* data) {
    hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    hid_t ds = H5Dcreate2(file_, name.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(ds, 0) << name;
    if (data) {
      EXPECT_GE(H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
    }
    H5Pclose(lcpl);
    H5Sclose(space);
    return ds;  // the caller adds attributes, then closes
  }
  static void attr_i64(hid_t obj, const char* name, int64_t v) {
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT64, &v), 0);
    H5Aclose(a);
    H5Sclose(space);
  }
  // A fixed-length string, as many tools write (h5py writes variable-length ones, which save() uses).
  static void attr_fixed_string(hid_t obj, const char* name, const std::string& s) {
    hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, s.size() + 3);  // NUL padding after the text
    std::string padded = s + std::string(3, '\0');
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(H5Awrite(a, type, padded.data()), 0);
    H5Aclose(a);
    H5Sclose(space);
    H5Tclose(type);
  }

 private:
  hid_t file_;
};

TEST(ArchiveForeign, AcceptsOtherWritersFilesWithKilnAttributes) {
  TempDir dir;
  std::string path = dir.file("foreign.h5");
  {
    RawFile f(path);
    ASSERT_TRUE(f.ok());
    f.version(1);
    float big_endian_src[3] = {1.f, 2.f, 3.f};
    // Stored big-endian: HDF5 converts on read, the dtype still matches (f32 = 4-byte float).
    hid_t ds = f.dataset("model/fc1/weight", H5T_IEEE_F32BE, {3}, nullptr);
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, big_endian_src);
    RawFile::attr_fixed_string(ds, "dtype", "f32");
    H5Dclose(ds);
    int32_t ints[2] = {5, -6};
    ds = f.dataset("counts", H5T_STD_I32LE, {2}, ints);
    RawFile::attr_fixed_string(ds, "dtype", "i32");
    RawFile::attr_fixed_string(ds, "unit", "ignored");  // extra dataset attributes are ignored
    H5Dclose(ds);
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f.id(), "small_int", H5T_STD_U8LE, space, H5P_DEFAULT, H5P_DEFAULT);
    uint8_t u = 200;
    H5Awrite(a, H5T_NATIVE_UINT8, &u);
    H5Aclose(a);
    a = H5Acreate2(f.id(), "single", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT);
    float x = 0.5f;
    H5Awrite(a, H5T_NATIVE_FLOAT, &x);
    H5Aclose(a);
    H5Sclose(space);
    RawFile::attr_fixed_string(f.id(), "note", "fixed");
  }
  Archive b = load(path);
  // Without a "name" attribute the name is the HDF5 path.
  const Tensor& w = b.tensor("model/fc1/weight");
  EXPECT_EQ(w.dtype(), DType::f32);
  EXPECT_EQ(static_cast<const float*>(w.raw_data())[2], 3.f);
  EXPECT_EQ(static_cast<const int32_t*>(b.tensor("counts").raw_data())[1], -6);
  EXPECT_EQ(b.get_int("small_int"), 200);
  EXPECT_EQ(b.get_double("single"), 0.5);
  EXPECT_EQ(b.get_string("note"), "fixed");
}

struct BadFileCase {
  const char* what;
  const char* message;  // expected in the error
};

// Writes a file with one defect, selected by `which`.
void write_bad_file(const std::string& path, int which) {
  RawFile f(path);
  ASSERT_TRUE(f.ok());
  if (which != 0) f.version(which == 1 ? 2 : 1);
  float v[2] = {1.f, 2.f};
  int64_t iv[2] = {1, 2};
  hid_t ds = which == 4 ? f.dataset("w", H5T_STD_I64LE, {2}, iv) : f.dataset("w", H5T_NATIVE_FLOAT, {2}, v);
  if (which == 2) {
  } else if (which == 3) {
    RawFile::attr_fixed_string(ds, "dtype", "f8");
  } else if (which == 5) {
    RawFile::attr_i64(ds, "dtype", 1);
  } else {
    RawFile::attr_fixed_string(ds, "dtype", "f32");
  }
  if (which == 6) RawFile::attr_fixed_string(ds, "name", "model/w");
  H5Dclose(ds);
}

TEST(ArchiveForeign, RejectsDefectsWithClearErrors) {
  TempDir dir;
  const BadFileCase cases[] = {
      {"no version", "not a Kiln archive (the root attribute 'kiln_format_version' is missing)"},
      {"newer version", "format version 2 is not supported"},
      {"no dtype", "dataset /w has no 'dtype' attribute"},
      {"unknown dtype", "unknown dtype 'f8'"},
      {"dtype vs storage", "attribute 'dtype' says f32 but the data are stored as 64-bit signed integer"},
      {"dtype not a string", "attribute 'dtype' has type int, expected a string"},
      {"name elsewhere", "attribute 'name' says 'model/w', which belongs at /model/w"},
  };
  for (int i = 0; i < int(std::size(cases)); ++i) {
    SCOPED_TRACE(cases[i].what);
    std::string path = dir.file("bad" + std::to_string(i) + ".h5");
    write_bad_file(path, i);
    ::testing::internal::CaptureStderr();
    std::string msg = error_of([&] { load(path); });
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(cases[i].message), std::string::npos) << msg;
  }
}

TEST(ArchiveForeign, SavedLayoutThroughTheCApi) {
  TempDir dir;
  std::string path = dir.file("ckpt.h5");
  Archive a;
  a.add("model/fc1.weight", empty({2, 3}, {.dtype = DType::f16}));
  a.add("flag", empty({}, {.dtype = DType::boolean}));
  *static_cast<uint8_t*>(a.tensor("flag").raw_data()) = 1;
  save(path, a);

  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t ds = H5Dopen2(f, "/model/fc1/weight", H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  hid_t type = H5Dget_type(ds);
  EXPECT_EQ(H5Tget_class(type), H5T_FLOAT);
  EXPECT_EQ(H5Tget_size(type), 2u);
  size_t spos, epos, esize, mpos, msize;
  H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize);
  EXPECT_EQ(spos, 15u);
  EXPECT_EQ(epos, 10u);
  EXPECT_EQ(esize, 5u);
  EXPECT_EQ(mpos, 0u);
  EXPECT_EQ(msize, 10u);
  EXPECT_EQ(H5Tget_ebias(type), 15u);
  hid_t dcpl = H5Dget_create_plist(ds);
  EXPECT_EQ(H5Pget_layout(dcpl), H5D_CHUNKED);
  EXPECT_GE(H5Pget_nfilters(dcpl), 1);
  EXPECT_GT(H5Aexists(ds, "dtype"), 0);
  EXPECT_GT(H5Aexists(ds, "name"), 0);
  H5Pclose(dcpl);
  H5Tclose(type);
  H5Dclose(ds);

  ds = H5Dopen2(f, "/flag", H5P_DEFAULT);
  hid_t space = H5Dget_space(ds);
  EXPECT_EQ(H5Sget_simple_extent_type(space), H5S_SCALAR);
  uint8_t flag = 0;
  H5Dread(ds, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, &flag);
  EXPECT_EQ(flag, 1);
  H5Sclose(space);
  H5Dclose(ds);
  EXPECT_GT(H5Aexists(f, "kiln_format_version"), 0);
  H5Fclose(f);
}



}  // namespace
}  // namespace kiln::archive::test
