// The RRef control messages' codec (rref_control.h): each kind is encoded as the callable name and
// argument list the wire has always carried, decodes back to its fields, and a malformed argument
// list of any kind is refused with an error naming the argument, never an exception.

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "rref_control.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace rref_control_test {

using ::testing::HasSubstr;

std::vector<int64_t> ints_of(const std::vector<c10::IValue>& args, size_t count) {
  std::vector<int64_t> ints;
  for (size_t i = 0; i < count; ++i) ints.push_back(args[i].toInt());
  return ints;
}

// A message of ids alone travels as `callable` with those ids, in order, as ints.
void expect_ids_on_the_wire(const ControlRequest& request, const std::string& callable,
                            const std::vector<int64_t>& ids) {
  EXPECT_EQ(request.callable, callable);
  ASSERT_EQ(request.args.size(), ids.size()) << callable;
  EXPECT_EQ(ints_of(request.args, ids.size()), ids) << callable;
}

TEST(RRefControl, EncodingIsTheWiresArgumentList) {
  ControlRequest create = encode_control(
      CreateMessage{{1, 2}, {3, 4}, "add", {c10::IValue(int64_t{5}), c10::IValue("six")}});
  EXPECT_EQ(create.callable, "__distoptim.rref.create");
  ASSERT_EQ(create.args.size(), 6u);
  EXPECT_EQ(ints_of(create.args, 4), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(create.args[4].toStringRef(), "add");
  ASSERT_TRUE(create.args[5].isList());
  const auto call_args = create.args[5].toListRef();
  ASSERT_EQ(call_args.size(), 2u);
  EXPECT_EQ(call_args[0].toInt(), 5);
  EXPECT_EQ(call_args[1].toStringRef(), "six");

  expect_ids_on_the_wire(encode_control(FetchMessage{{1, 2}}), "__distoptim.rref.fetch", {1, 2});
  expect_ids_on_the_wire(encode_control(ForkMessage{{1, 2}, {3, 4}}), "__distoptim.rref.fork",
                         {1, 2, 3, 4});
  expect_ids_on_the_wire(encode_control(AcceptMessage{{3, 4}}), "__distoptim.rref.accept", {3, 4});
  expect_ids_on_the_wire(encode_control(DeleteMessage{{1, 2}, {3, 4}}), "__distoptim.rref.delete",
                         {1, 2, 3, 4});
}

TEST(RRefControl, EveryKindDecodesToItsFields) {
  CreateMessage create;
  ASSERT_FALSE(decode_control(
      encode_control(CreateMessage{{1, 2}, {3, 4}, "add", {c10::IValue(int64_t{5})}}).args,
      &create));
  EXPECT_EQ(create.rref_id.created_on, 1);
  EXPECT_EQ(create.rref_id.local_id, 2);
  EXPECT_EQ(create.fork_id.created_on, 3);
  EXPECT_EQ(create.fork_id.local_id, 4);
  EXPECT_EQ(create.callable, "add");
  ASSERT_EQ(create.args.size(), 1u);
  EXPECT_EQ(create.args[0].toInt(), 5);

  FetchMessage fetch;
  ASSERT_FALSE(decode_control(encode_control(FetchMessage{{1, 2}}).args, &fetch));
  EXPECT_EQ(fetch.rref_id.created_on, 1);
  EXPECT_EQ(fetch.rref_id.local_id, 2);

  ForkMessage fork;
  ASSERT_FALSE(decode_control(encode_control(ForkMessage{{1, 2}, {3, 4}}).args, &fork));
  EXPECT_EQ(fork.rref_id.local_id, 2);
  EXPECT_EQ(fork.fork_id.created_on, 3);

  AcceptMessage accept;
  ASSERT_FALSE(decode_control(encode_control(AcceptMessage{{3, 4}}).args, &accept));
  EXPECT_EQ(accept.fork_id.created_on, 3);
  EXPECT_EQ(accept.fork_id.local_id, 4);

  DeleteMessage deleted;
  ASSERT_FALSE(decode_control(encode_control(DeleteMessage{{1, 2}, {3, 4}}).args, &deleted));
  EXPECT_EQ(deleted.rref_id.created_on, 1);
  EXPECT_EQ(deleted.fork_id.local_id, 4);
}

TEST(RRefControl, MalformedArgumentsAreNamed) {
  const std::vector<c10::IValue> ids = {int64_t{0}, int64_t{1}, int64_t{0}, int64_t{2}};
  FetchMessage fetch;
  EXPECT_THAT(decode_control({}, &fetch).value_or(""), HasSubstr("0 arguments, expected 2"));
  EXPECT_THAT(decode_control(ids, &fetch).value_or(""), HasSubstr("4 arguments, expected 2"));
  EXPECT_THAT(decode_control({c10::IValue("0"), int64_t{1}}, &fetch).value_or(""),
              HasSubstr("argument 0 (rref created_on) is not an int"));
  ForkMessage fork;
  EXPECT_THAT(decode_control({int64_t{0}, int64_t{1}, int64_t{0}, int64_t{-2}}, &fork).value_or(""),
              HasSubstr("'fork': argument 3 (fork local_id) is negative: -2"));
  CreateMessage create;
  std::vector<c10::IValue> no_callable = ids;
  no_callable.emplace_back(int64_t{7});
  no_callable.emplace_back(c10::impl::GenericList(c10::AnyType::get()));
  EXPECT_THAT(decode_control(no_callable, &create).value_or(""),
              HasSubstr("'create': argument 4 (callable) is not a string"));
  std::vector<c10::IValue> no_list = ids;
  no_list.emplace_back("add");
  no_list.emplace_back(int64_t{7});
  EXPECT_THAT(decode_control(no_list, &create).value_or(""),
              HasSubstr("argument 5 (arguments) is not a list"));
}

// Each argument of each kind replaced by a value of every other kind, and each list cut short
// or grown by one: every one is refused, without an exception.
template <class Message>
void expect_every_corruption_refused(const std::vector<c10::IValue>& good) {
  const std::vector<c10::IValue> others = {
      c10::IValue(),
      c10::IValue(1.5),
      c10::IValue(true),
      c10::IValue("text"),
      c10::IValue(int64_t{-1}),
      c10::IValue(at::ones({2})),
      c10::IValue(c10::impl::GenericList(c10::AnyType::get()))};
  Message message;
  ASSERT_FALSE(decode_control(good, &message));
  for (size_t index = 0; index < good.size(); ++index) {
    for (const c10::IValue& other : others) {
      std::vector<c10::IValue> bad = good;
      bad[index] = other;
      Status error;
      ASSERT_NO_THROW(error = decode_control(bad, &message));
      // Another value of the same kind still decodes (a create's callable and arguments), and
      // so does -1 as a creator id (the receiver checks it against its workers), not as a local
      // id (ids come in pairs at 0, 1 and 2, 3).
      const bool creator_id = index < 4 && index % 2 == 0;
      const bool still_fine = other.isInt() ? creator_id : other.tagKind() == good[index].tagKind();
      EXPECT_EQ(!error, still_fine) << "argument " << index << " as " << other.tagKind();
    }
  }
  std::vector<c10::IValue> shorter(good.begin(), good.end() - 1);
  EXPECT_TRUE(decode_control(shorter, &message));
  std::vector<c10::IValue> longer = good;
  longer.emplace_back(int64_t{0});
  EXPECT_TRUE(decode_control(longer, &message));
}

TEST(RRefControl, EveryCorruptionIsRefused) {
  expect_every_corruption_refused<CreateMessage>(
      encode_control(CreateMessage{{0, 1}, {0, 2}, "add", {}}).args);
  expect_every_corruption_refused<FetchMessage>(encode_control(FetchMessage{{0, 1}}).args);
  expect_every_corruption_refused<ForkMessage>(encode_control(ForkMessage{{0, 1}, {0, 2}}).args);
  expect_every_corruption_refused<AcceptMessage>(encode_control(AcceptMessage{{0, 2}}).args);
  expect_every_corruption_refused<DeleteMessage>(
      encode_control(DeleteMessage{{0, 1}, {0, 2}}).args);
}

}  // namespace rref_control_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
