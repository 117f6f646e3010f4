// Member keys (member_key.h) and the directory of the members' keys (member_keys.h): a signature
// verifies only under its signer's key and over what was signed; a key once fixed for an id is
// never replaced; lookups are answered once each, bounded in number, and stopped cleanly.

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "member_key.h"
#include "member_keys.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace member_key_test {

using ::testing::HasSubstr;

TEST(MemberKey, ASignatureVerifiesOnlyUnderItsKeyAndOverWhatItSigned) {
  const MemberKey alice = MemberKey::generate();
  const MemberKey mallory = MemberKey::generate();
  EXPECT_EQ(alice.public_key().size(), MemberKey::kPublicKeyBytes);
  EXPECT_NE(alice.public_key(), mallory.public_key());
  const std::string signature = alice.sign("worker 2 connecting");
  EXPECT_EQ(signature.size(), MemberKey::kSignatureBytes);
  EXPECT_TRUE(member_signature_valid(alice.public_key(), "worker 2 connecting", signature));
  EXPECT_FALSE(member_signature_valid(mallory.public_key(), "worker 2 connecting", signature));
  EXPECT_FALSE(member_signature_valid(alice.public_key(), "worker 3 connecting", signature));
  std::string flipped = signature;
  flipped[10] ^= 1;
  EXPECT_FALSE(member_signature_valid(alice.public_key(), "worker 2 connecting", flipped));
  EXPECT_FALSE(
      member_signature_valid(alice.public_key().substr(1), "worker 2 connecting", signature));
  EXPECT_FALSE(
      member_signature_valid(alice.public_key(), "worker 2 connecting", signature.substr(1)));
  EXPECT_FALSE(member_signature_valid(std::string(MemberKey::kPublicKeyBytes, '\0'),
                                      "worker 2 connecting", signature));
  // The private half rebuilds the same key pair (a leaked key signs as its owner).
  const MemberKey copy = MemberKey::from_private_key(alice.private_key());
  EXPECT_EQ(copy.public_key(), alice.public_key());
  EXPECT_TRUE(member_signature_valid(alice.public_key(), "x", copy.sign("x")));
  EXPECT_THROW(MemberKey::from_private_key("short"), c10::ValueError);
}

TEST(MemberKey, HexRoundTripsAndRefusesWhatIsNotHex) {
  const std::string bytes("\x00\x01\x7f\x80\xff", 5);
  EXPECT_EQ(to_hex(bytes), "00017f80ff");
  EXPECT_EQ(from_hex("00017f80ff"), bytes);
  EXPECT_EQ(from_hex(""), std::string());
  EXPECT_FALSE(from_hex("abc"));
  EXPECT_FALSE(from_hex("0g"));
  EXPECT_FALSE(from_hex("AB"));
}

TEST(MemberKeys, AKeyOnceFixedIsNeverReplaced) {
  MemberKeys keys;
  keys.fix(3, "key-of-3");
  keys.fix(3, "key-of-3");
  try {
    keys.fix(3, "another");
    FAIL() << "a second key for id 3 was taken";
  } catch (const c10::ValueError& error) {
    EXPECT_THAT(error.what(),
                HasSubstr("worker id 3 was published with two different member keys"));
  }
  EXPECT_EQ(keys.find(3), "key-of-3");
  EXPECT_FALSE(keys.find(4));
  // Without a lookup (a static group) an unknown id is refused at once.
  std::string why;
  bool answered = false;
  keys.resolve(4, [&](std::optional<std::string> key, const std::string& reason) {
    EXPECT_FALSE(key);
    why = reason;
    answered = true;
  });
  EXPECT_TRUE(answered);
  EXPECT_EQ(why, "no worker of this group has id 4");
}

TEST(MemberKeys, LookupsAreAnsweredOnceEachBoundedAndStopped) {
  std::mutex mutex;
  std::condition_variable released;
  bool release = false;
  std::atomic<int> lookups{0};
  MemberKeys keys([&](int id) -> std::string {
    ++lookups;
    std::unique_lock<std::mutex> lock(mutex);
    released.wait(lock, [&] { return release; });
    if (id == 7) throw std::runtime_error("no worker has claimed id 7");
    return "key-of-" + std::to_string(id);
  });
  std::mutex answers_mutex;
  std::vector<std::string> answers;
  const auto record = [&](std::optional<std::string> key, const std::string& why) {
    std::lock_guard<std::mutex> lock(answers_mutex);
    answers.push_back(key ? *key : "none: " + why);
  };
  // Two waits for one id share one lookup.
  keys.resolve(5, record);
  keys.resolve(5, record);
  keys.resolve(7, record);
  // Past the bound, more ids are refused at once.
  for (int id = 100; id < 100 + static_cast<int>(MemberKeys::kMaxPendingLookups) - 2; ++id) {
    keys.resolve(id, [](std::optional<std::string>, const std::string&) {});
  }
  keys.resolve(9999, record);
  {
    std::lock_guard<std::mutex> lock(answers_mutex);
    ASSERT_EQ(answers.size(), 1u);
    EXPECT_THAT(answers[0], HasSubstr("too many connections wait for their worker's key (256)"));
    answers.clear();
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    release = true;
  }
  released.notify_all();
  // Answered in order; the failed lookup is not cached, the successful one is fixed.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!keys.find(100 + static_cast<int>(MemberKeys::kMaxPendingLookups) - 3) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling: the lookups drain
  }
  keys.stop();
  std::lock_guard<std::mutex> lock(answers_mutex);
  EXPECT_EQ(answers,
            (std::vector<std::string>{"key-of-5", "key-of-5", "none: no worker has claimed id 7"}));
  EXPECT_EQ(keys.find(5), "key-of-5");
  EXPECT_FALSE(keys.find(7));
  EXPECT_EQ(lookups.load(), static_cast<int>(MemberKeys::kMaxPendingLookups));
  // After stop, a lookup is refused at once.
  std::string why;
  keys.resolve(8, [&](std::optional<std::string> key, const std::string& reason) {
    EXPECT_FALSE(key);
    why = reason;
  });
  EXPECT_EQ(why, "this worker is stopping");
}

}  // namespace member_key_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
