// SHA-256 and HMAC-SHA256 (collectives/auth.h, Note [Job secret]) against the published
// vectors: FIPS 180-4's examples (NIST's "SHA-256 example" file and the million-'a'
// message) and RFC 4231's HMAC-SHA256 test cases, including the keys longer than a block
// (hashed first) and a message that spans several blocks.
#include "collectives/auth.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <string>

using namespace tetra::collectives;

namespace {

std::string bytes_of(const std::string& hex) {
  std::string out;
  EXPECT_TRUE(from_hex(hex, out)) << hex;
  return out;
}

}  // namespace

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(to_hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(to_hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(to_hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(to_hex(sha256("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmn"
                          "opqrsmnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(to_hex(sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Lengths around the padding boundary (55, 56, 63, 64, 65 bytes) against values computed
// with Python's hashlib.
TEST(Sha256, PaddingBoundaries) {
  const std::pair<int, const char*> cases[] = {
      {55, "d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072"},
      {56, "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e"},
      {63, "75220b47218278e656f2013bb8f0c455a25eaf01e86c64924e9d48d89776d6f2"},
      {64, "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c"},
      {65, "9537c5fdf120482f7d58d25e9ed583f52c02b4e304ea814db1633ad565aed7e9"}};
  for (const auto& [n, hex] : cases) EXPECT_EQ(to_hex(sha256(std::string(n, 'x'))), hex) << n;
}

TEST(HmacSha256, Rfc4231) {
  struct Case {
    std::string key, data, mac;
  };
  const Case cases[] = {
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {bytes_of("0102030405060708090a0b0c0d0e0f10111213141516171819"), std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. The key needs to be "
       "hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) EXPECT_EQ(to_hex(hmac_sha256(c.key, c.data)), c.mac) << c.data;
}

TEST(Auth, HexAndConstantTimeComparison) {
  std::string out;
  EXPECT_TRUE(from_hex("00ff7A", out));
  EXPECT_EQ(out, std::string("\x00\xff\x7a", 3));
  EXPECT_FALSE(from_hex("abc", out));
  EXPECT_FALSE(from_hex("zz", out));
  EXPECT_TRUE(equal_in_constant_time("abc", "abc"));
  EXPECT_FALSE(equal_in_constant_time("abc", "abd"));
  EXPECT_FALSE(equal_in_constant_time("abc", "abcd"));
}

TEST(Auth, RandomBytesDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 8; ++i) {
    const std::string r = random_bytes(32);
    EXPECT_EQ(r.size(), 32u);
    seen.insert(r);
  }
  EXPECT_EQ(seen.size(), 8u);
}
