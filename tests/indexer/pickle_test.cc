// The restricted unpickler: real Python pickles at every protocol decode to
// the same inert tree; hostile pickles are refused or stay inert and run
// nothing; every limit holds with a message naming the offset and opcode.
//
// Byte strings were made with CPython 3.11's pickle (the command is above
// each) and pasted; the hostile ones that no pickler writes are built here.
#include "indexer/pickle.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "indexer/dcp_metadata.h"

namespace ckptfs {
namespace {

using Kind = PickleValue::Kind;
using namespace std::string_literals;  // "..."s keeps embedded NULs

constexpr const char* kPwned = "/tmp/ckptfs_pickle_test_pwned";

std::unique_ptr<const PickleDocument> MustUnpickle(const std::string& bytes, const UnpickleLimits& limits = {}) {
  auto doc = Unpickle(bytes, limits);
  EXPECT_TRUE(doc.ok()) << doc.status().ToString();
  if (!doc.ok()) return nullptr;
  return std::move(doc).value();
}

Status UnpickleError(const std::string& bytes, const UnpickleLimits& limits = {}) {
  auto doc = Unpickle(bytes, limits);
  if (doc.ok()) return Status::OK();
  return doc.status();
}

// ---------------------------------------------------------------------------
// Real pickles

// v = {'a': (1, 2.5, b'x\x00'), 'b': [None, True, False], 'c': {1, 2},
//      'd': frozenset({3}), 'big': 2**70, 'neg': -2**63,
//      'od': collections.OrderedDict([('k', 'v')]), 'u': 'h\u00e9\u20ac',
//      'ba': bytearray(b'zz')}
// python3 -c "import pickle; print(pickle.dumps(v, protocol=P))"
const std::string kMixed[6] = {
    "(dp0\x0aVa\x0ap1\x0a(I1\x0a""F2.5\x0a""c_codecs\x0a""encode\x0ap2\x0a(Vx\x5cu0000\x0ap3\x0aVlatin1\x0ap4\x0atp5\x0aRp6\x0atp7\x0asVb\x0ap8\x0a(lp9\x0aNaI01\x0a""aI00\x0a""asVc\x0ap10\x0a""c__builtin__\x0aset\x0ap11\x0a((lp12\x0aI1\x0a""aI2\x0a""atp13\x0aRp14\x0asVd\x0ap15\x0a""c__builtin__\x0a""frozenset\x0ap16\x0a((lp17\x0aI3\x0a""atp18\x0aRp19\x0asVbig\x0ap20\x0aL1180591620717411303424L\x0asVneg\x0ap21\x0aL-9223372036854775808L\x0asVod\x0ap22\x0a""ccollections\x0aOrderedDict\x0ap23\x0a(tRp24\x0aVk\x0ap25\x0aVv\x0ap26\x0assVu\x0ap27\x0aVh\xe9\x5cu20ac\x0ap28\x0asVba\x0ap29\x0a""c__builtin__\x0a""bytearray\x0ap30\x0a(g2\x0a(Vzz\x0ap31\x0ag4\x0atp32\x0aRp33\x0atp34\x0aRp35\x0as."s,
    "}q\x00(X\x01\x00\x00\x00""aq\x01(K\x01G@\x04\x00\x00\x00\x00\x00\x00""c_codecs\x0a""encode\x0aq\x02(X\x02\x00\x00\x00x\x00q\x03X\x06\x00\x00\x00latin1q\x04tq\x05Rq\x06tq\x07X\x01\x00\x00\x00""bq\x08]q\x09(NI01\x0aI00\x0a""eX\x01\x00\x00\x00""cq\x0a""c__builtin__\x0aset\x0aq\x0b(]q\x0c(K\x01K\x02""etq\x0dRq\x0eX\x01\x00\x00\x00""dq\x0f""c__builtin__\x0a""frozenset\x0aq\x10(]q\x11K\x03""atq\x12Rq\x13X\x03\x00\x00\x00""bigq\x14L1180591620717411303424L\x0aX\x03\x00\x00\x00negq\x15L-9223372036854775808L\x0aX\x02\x00\x00\x00odq\x16""ccollections\x0aOrderedDict\x0aq\x17)Rq\x18X\x01\x00\x00\x00kq\x19X\x01\x00\x00\x00vq\x1asX\x01\x00\x00\x00uq\x1bX\x06\x00\x00\x00h\xc3\xa9\xe2\x82\xacq\x1cX\x02\x00\x00\x00""baq\x1d""c__builtin__\x0a""bytearray\x0aq\x1e(h\x02(X\x02\x00\x00\x00zzq\x1fh\x04tq Rq!tq\x22Rq#u."s,
    "\x80\x02}q\x00(X\x01\x00\x00\x00""aq\x01K\x01G@\x04\x00\x00\x00\x00\x00\x00""c_codecs\x0a""encode\x0aq\x02X\x02\x00\x00\x00x\x00q\x03X\x06\x00\x00\x00latin1q\x04\x86q\x05Rq\x06\x87q\x07X\x01\x00\x00\x00""bq\x08]q\x09(N\x88\x89""eX\x01\x00\x00\x00""cq\x0a""c__builtin__\x0aset\x0aq\x0b]q\x0c(K\x01K\x02""e\x85q\x0dRq\x0eX\x01\x00\x00\x00""dq\x0f""c__builtin__\x0a""frozenset\x0aq\x10]q\x11K\x03""a\x85q\x12Rq\x13X\x03\x00\x00\x00""bigq\x14\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@X\x03\x00\x00\x00negq\x15\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80X\x02\x00\x00\x00odq\x16""ccollections\x0aOrderedDict\x0aq\x17)Rq\x18X\x01\x00\x00\x00kq\x19X\x01\x00\x00\x00vq\x1asX\x01\x00\x00\x00uq\x1bX\x06\x00\x00\x00h\xc3\xa9\xe2\x82\xacq\x1cX\x02\x00\x00\x00""baq\x1d""c__builtin__\x0a""bytearray\x0aq\x1eh\x02X\x02\x00\x00\x00zzq\x1fh\x04\x86q Rq!\x85q\x22Rq#u."s,
    "\x80\x03}q\x00(X\x01\x00\x00\x00""aq\x01K\x01G@\x04\x00\x00\x00\x00\x00\x00""C\x02x\x00q\x02\x87q\x03X\x01\x00\x00\x00""bq\x04]q\x05(N\x88\x89""eX\x01\x00\x00\x00""cq\x06""cbuiltins\x0aset\x0aq\x07]q\x08(K\x01K\x02""e\x85q\x09Rq\x0aX\x01\x00\x00\x00""dq\x0b""cbuiltins\x0a""frozenset\x0aq\x0c]q\x0dK\x03""a\x85q\x0eRq\x0fX\x03\x00\x00\x00""bigq\x10\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@X\x03\x00\x00\x00negq\x11\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80X\x02\x00\x00\x00odq\x12""ccollections\x0aOrderedDict\x0aq\x13)Rq\x14X\x01\x00\x00\x00kq\x15X\x01\x00\x00\x00vq\x16sX\x01\x00\x00\x00uq\x17X\x06\x00\x00\x00h\xc3\xa9\xe2\x82\xacq\x18X\x02\x00\x00\x00""baq\x19""cbuiltins\x0a""bytearray\x0aq\x1a""C\x02zzq\x1b\x85q\x1cRq\x1du."s,
    "\x80\x04\x95\xbf\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01""a\x94K\x01G@\x04\x00\x00\x00\x00\x00\x00""C\x02x\x00\x94\x87\x94\x8c\x01""b\x94]\x94(N\x88\x89""e\x8c\x01""c\x94\x8f\x94(K\x01K\x02\x90\x8c\x01""d\x94(K\x03\x91\x94\x8c\x03""big\x94\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8c\x03neg\x94\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8c\x02od\x94\x8c\x0b""collections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94\x8c\x01k\x94\x8c\x01v\x94s\x8c\x01u\x94\x8c\x06h\xc3\xa9\xe2\x82\xac\x94\x8c\x02""ba\x94\x8c\x08""builtins\x94\x8c\x09""bytearray\x94\x93\x94""C\x02zz\x94\x85\x94R\x94u."s,
    "\x80\x05\x95\xa9\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01""a\x94K\x01G@\x04\x00\x00\x00\x00\x00\x00""C\x02x\x00\x94\x87\x94\x8c\x01""b\x94]\x94(N\x88\x89""e\x8c\x01""c\x94\x8f\x94(K\x01K\x02\x90\x8c\x01""d\x94(K\x03\x91\x94\x8c\x03""big\x94\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8c\x03neg\x94\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8c\x02od\x94\x8c\x0b""collections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94\x8c\x01k\x94\x8c\x01v\x94s\x8c\x01u\x94\x8c\x06h\xc3\xa9\xe2\x82\xac\x94\x8c\x02""ba\x94\x96\x02\x00\x00\x00\x00\x00\x00\x00zz\x94u."s,
};

constexpr const char* kMixedRendered =
    "{'a': (1, 2.5, b'x\\x00'), 'b': [None, True, False], 'c': {1, 2}, 'd': frozenset({3}), "
    "'big': 1180591620717411303424, 'neg': -9223372036854775808, 'od': OrderedDict({'k': 'v'}), "
    "'u': 'h\xc3\xa9\xe2\x82\xac', 'ba': b'zz'}";

TEST(PickleTest, EveryProtocolDecodesToTheSameTree) {
  for (int proto = 0; proto <= 5; ++proto) {
    SCOPED_TRACE("protocol " + std::to_string(proto));
    auto doc = MustUnpickle(kMixed[proto]);
    ASSERT_TRUE(doc);
    EXPECT_EQ(doc->root().DebugString(), kMixedRendered);
    EXPECT_FALSE(doc->has_unknown_globals());
    EXPECT_EQ(doc->protocol(), proto < 2 ? 0 : proto);
    EXPECT_EQ(doc->end_offset(), kMixed[proto].size());
  }
}

TEST(PickleTest, AccessorsPatternMatch) {
  auto doc = MustUnpickle(kMixed[4]);
  ASSERT_TRUE(doc);
  const PickleValue& root = doc->root();
  ASSERT_EQ(root.kind(), Kind::kDict);
  EXPECT_FALSE(root.is_ordered_dict());
  EXPECT_EQ(root.AsDict()->size(), 9u);
  EXPECT_EQ(root.DictGet("missing"), nullptr);

  const PickleValue* a = root.DictGet("a");
  ASSERT_TRUE(a && a->AsTuple());
  EXPECT_EQ(a->AsTuple()->size(), 3u);
  EXPECT_EQ(a->At(0)->AsInt(), 1);
  EXPECT_EQ(a->At(1)->AsFloat(), 2.5);
  EXPECT_EQ(*a->At(2)->AsBytes(), "x\0"s);
  EXPECT_EQ(a->At(3), nullptr);
  EXPECT_FALSE(a->At(0)->AsBool());  // no int <-> bool conversion
  EXPECT_FALSE(a->At(0)->AsFloat());

  const PickleValue* b = root.DictGet("b");
  ASSERT_TRUE(b->AsList());
  EXPECT_TRUE(b->At(0)->IsNone());
  EXPECT_EQ(b->At(1)->AsBool(), true);
  EXPECT_EQ(b->At(2)->AsBool(), false);
  EXPECT_FALSE(b->AsTuple());
  EXPECT_TRUE(b->AsSequence());

  EXPECT_EQ(root.DictGet("c")->kind(), Kind::kSet);
  EXPECT_EQ(root.DictGet("d")->kind(), Kind::kFrozenSet);
  EXPECT_EQ(root.DictGet("c")->AsSet()->size(), 2u);
  EXPECT_EQ(*root.DictGet("big")->BigIntText(), "1180591620717411303424");
  EXPECT_FALSE(root.DictGet("big")->AsInt());
  EXPECT_EQ(root.DictGet("neg")->AsInt(), INT64_MIN);
  EXPECT_TRUE(root.DictGet("od")->is_ordered_dict());
  EXPECT_EQ(*root.DictGet("od")->DictGet("k")->AsStr(), "v");
  EXPECT_EQ(*root.DictGet("u")->AsStr(), "h\xc3\xa9\xe2\x82\xac");
  EXPECT_EQ(*root.DictGet("ba")->AsBytes(), "zz");
}

// torch.save(model.state_dict()) data.pkl head, as torch writes it
// (protocol 2, GLOBAL, BINPERSID); from tests/indexer/testdata/views.pt.
TEST(PickleTest, TensorRebuildCallIsInertAndMatchable) {
  const std::string bytes =
      "\x80\x02}q\x00X\x01\x00\x00\x00tq\x01""ctorch._utils\n_rebuild_tensor_v2\nq\x02((X\x07\x00\x00\x00"
      "storageq\x03""ctorch\nFloatStorage\nq\x04X\x01\x00\x00\x00""0q\x05X\x03\x00\x00\x00""cpuq\x06"
      "K\x0ctq\x07QK\x00K\x04K\x03\x86q\x08K\x01K\x04\x86q\x09\x89""ccollections\nOrderedDict\nq\x0a)Rq\x0b"
      "tq\x0cRq\x0ds."s;
  auto doc = MustUnpickle(bytes);
  ASSERT_TRUE(doc);
  EXPECT_FALSE(doc->has_unknown_globals());
  const PickleValue* t = doc->root().DictGet("t");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->kind(), Kind::kReduce);
  EXPECT_TRUE(t->IsCallOf("torch._utils", "_rebuild_tensor_v2"));
  EXPECT_TRUE(t->callable()->is_allowed_global());
  const auto* args = t->CallArgs("torch._utils", "_rebuild_tensor_v2");
  ASSERT_TRUE(args);
  ASSERT_EQ(args->size(), 6u);
  const PickleValue* pid = (*args)[0]->pid();
  ASSERT_TRUE(pid);
  EXPECT_TRUE(pid->At(1)->IsGlobal("torch", "FloatStorage"));
  EXPECT_EQ(*pid->At(2)->AsStr(), "0");
  EXPECT_EQ(pid->At(4)->AsInt(), 12);
  EXPECT_TRUE((*args)[5]->is_ordered_dict());  // backward_hooks
  EXPECT_EQ(t->DebugString(),
            "torch._utils._rebuild_tensor_v2(persistent_id(('storage', torch.FloatStorage, '0', 'cpu', 12)), 0, "
            "(4, 3), (1, 4), False, OrderedDict({}))");
}

TEST(PickleTest, SharedReferencesSeeLaterMutation) {
  // L = []; t = (L, L); L.append(7); STOP t  ->  ([7], [7])
  auto doc = MustUnpickle("\x80\x02]q\x00h\x00h\x00\x86q\x01""0K\x07""a0h\x01."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().DebugString(), "([7], [7])");
  EXPECT_EQ(doc->root().At(0), doc->root().At(1));
}

TEST(PickleTest, BuildWrapsInPlaceSoMemoReferencesSeeTheState) {
  // o = mod.C.__new__(mod.C); memo[0] = o; BUILD(o, {'x': 1}); STOP [memo[0]]
  auto doc = MustUnpickle("\x80\x04\x8c\x03mod\x8c\x01""C\x93)\x81q\x00}\x8c\x01xK\x01sb0]h\x00""a."s);
  ASSERT_TRUE(doc);
  const PickleValue* o = doc->root().At(0);
  ASSERT_EQ(o->kind(), Kind::kBuild);
  EXPECT_EQ(o->built_object()->kind(), Kind::kNewObj);
  EXPECT_TRUE(o->Unwrapped().callable()->IsGlobal("mod", "C"));
  EXPECT_EQ(o->build_state()->DictGet("x")->AsInt(), 1);
  EXPECT_EQ(doc->unknown_globals(), std::vector<std::string>{"mod.C"});
  EXPECT_EQ(doc->root().DebugString(), "[mod.C.__new__().__setstate__({'x': 1})]");
}

TEST(PickleTest, SetItemsOnAnObjectAreRecordedNotApplied) {
  // collections.defaultdict(None) then SETITEMS {'k': 1}; APPENDS on a Reduce.
  auto doc = MustUnpickle("\x80\x02""ccollections\ndefaultdict\nN\x85R(X\x01\x00\x00\x00kK\x01u."s);
  ASSERT_TRUE(doc);
  const PickleValue& r = doc->root();
  ASSERT_EQ(r.kind(), Kind::kReduce);
  ASSERT_EQ(r.object_dict_items().size(), 1u);
  EXPECT_EQ(*r.object_dict_items()[0].key->AsStr(), "k");
  EXPECT_EQ(doc->unknown_globals(), std::vector<std::string>{"collections.defaultdict"});
}

TEST(PickleTest, TextOpcodes) {
  // Protocol 0 spellings: INT as bool, STRING with escapes, UNICODE escapes,
  // FLOAT, LONG, PERSID, GET/PUT.
  auto doc = MustUnpickle("(I01\nI-5\nS'a\\x41\\n\\'q'\nVcaf\\u00e9 \\U0001F600\np0\nF-0.25\nL12L\nPkey\ng0\nt."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().DebugString(),
            "(True, -5, 'aA\\n\\'q', 'caf\xc3\xa9 \xf0\x9f\x98\x80', -0.25, 12, persistent_id('key'), "
            "'caf\xc3\xa9 \xf0\x9f\x98\x80')");
}

TEST(PickleTest, LongIntegers) {
  // LONG1 of 9 bytes that still fits int64 (sign fill), one that does not,
  // and a negative LONG4.
  auto doc = MustUnpickle("\x80\x02(\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00"
                          "\x8b\x09\x00\x00\x00"  // LONG4, 9 bytes: -2**71
                          "\x00\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x00t."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().DebugString(), "(-1, 9223372036854775808, -2361183241434822606848, 0)");
}

TEST(PickleTest, TrailingBytesAfterStopAreIgnored) {
  auto doc = MustUnpickle("N.garbage"s);
  ASSERT_TRUE(doc);
  EXPECT_TRUE(doc->root().IsNone());
  EXPECT_EQ(doc->end_offset(), 2u);
}

TEST(PickleTest, DuplicateDictKeysKeepOrderAndTheLastValueWins) {
  auto doc = MustUnpickle("\x80\x02}(X\x01\x00\x00\x00kK\x01X\x01\x00\x00\x00kK\x02K\x05K\x06u."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().AsDict()->size(), 3u);
  EXPECT_EQ(doc->root().DictGet("k")->AsInt(), 2);
  EXPECT_EQ(doc->root().DictGetInt(5)->AsInt(), 6);
}

// ---------------------------------------------------------------------------
// Hostile pickles: nothing runs.

class PickleHostileTest : public ::testing::Test {
 protected:
  void SetUp() override { ::unlink(kPwned); }
  void TearDown() override { EXPECT_NE(::access(kPwned, F_OK), 0) << "a pickle ran code"; }
};

// class Sys: __reduce__ = lambda s: (os.system, ("touch /tmp/ckptfs_pickle_test_pwned",))
// python3 -c "print(pickle.dumps(Sys(), protocol=P))" for P = 0, 2, 4.
TEST_F(PickleHostileTest, OsSystemViaGlobalReduceStaysInert) {
  const std::string kSys[] = {
      "cposix\x0asystem\x0ap0\x0a(Vtouch /tmp/ckptfs_pickle_test_pwned\x0ap1\x0atp2\x0aRp3\x0a."s,
      "\x80\x02""cposix\x0asystem\x0aq\x00X#\x00\x00\x00touch /tmp/ckptfs_pickle_test_pwnedq\x01\x85q\x02Rq\x03."s,
      "\x80\x04\x95>\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94\x8c#touch "
      "/tmp/ckptfs_pickle_test_pwned\x94\x85\x94R\x94."s,
  };
  for (const auto& bytes : kSys) {
    auto doc = MustUnpickle(bytes);
    ASSERT_TRUE(doc);
    EXPECT_EQ(doc->unknown_globals(), std::vector<std::string>{"posix.system"});
    const PickleValue& r = doc->root();
    ASSERT_EQ(r.kind(), Kind::kReduce);
    EXPECT_TRUE(r.callable()->IsGlobal("posix", "system"));
    EXPECT_FALSE(r.callable()->is_allowed_global());
    EXPECT_EQ(*r.args()->At(0)->AsStr(), "touch /tmp/ckptfs_pickle_test_pwned");
    EXPECT_EQ(r.DebugString(), "posix.system('touch /tmp/ckptfs_pickle_test_pwned')");
  }
  EXPECT_NE(::access(kPwned, F_OK), 0);
}

// class Ev: __reduce__ = lambda s: (builtins.eval, ("__import__('os').system('touch ...')",))
TEST_F(PickleHostileTest, BuiltinsEvalViaStackGlobalStaysInert) {
  auto doc = MustUnpickle(
      "\x80\x04\x95Z\x00\x00\x00\x00\x00\x00\x00\x8c\x08""builtins\x94\x8c\x04""eval\x94\x93\x94\x8c>__import__("
      "'os').system('touch /tmp/ckptfs_pickle_test_pwned')\x94\x85\x94R\x94."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->unknown_globals(), std::vector<std::string>{"builtins.eval"});
  EXPECT_TRUE(doc->root().IsCallOf("builtins", "eval"));
}

TEST_F(PickleHostileTest, BuildOnAGlobalStaysInert) {
  // posix.system.__setstate__({'x': 'touch ...'}) -- Python would setattr on
  // the function; here it is a Build node and nothing else.
  auto doc = MustUnpickle("\x80\x02""cposix\nsystem\n}X\x01\x00\x00\x00xX\x05\x00\x00\x00touchsb."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().kind(), Kind::kBuild);
  EXPECT_TRUE(doc->root().built_object()->IsGlobal("posix", "system"));
  EXPECT_TRUE(doc->unknown_globals() == std::vector<std::string>{"posix.system"});
}

TEST_F(PickleHostileTest, BuildOnABuiltinValueIsRefused) {
  Status s = UnpickleError("\x80\x02]}b."s);
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_EQ(s.message(), "pickle: offset 4: BUILD target is a list, which has no state");
}

TEST_F(PickleHostileTest, ExtensionCodesAreRefused) {
  struct Case {
    std::string bytes;
    const char* message;
  } cases[] = {
      {"\x80\x02\x82\x01."s, "pickle: offset 2: EXT1 is refused: extension codes name callables from the copyreg registry"},
      {"\x80\x02\x83\x01\x00."s, "pickle: offset 2: EXT2 is refused: extension codes name callables from the copyreg registry"},
      {"\x80\x02\x84\x01\x00\x00\x00."s, "pickle: offset 2: EXT4 is refused: extension codes name callables from the copyreg registry"},
  };
  for (const auto& c : cases) {
    Status s = UnpickleError(c.bytes);
    EXPECT_EQ(s.code(), Status::Code::kNotSupported);
    EXPECT_EQ(s.message(), c.message);
  }
}

TEST_F(PickleHostileTest, InstAndObjAreRefused) {
  // INST: MARK args 'i' module\n name\n ; OBJ: MARK cls args 'o'.
  Status inst = UnpickleError("(S'touch /tmp/ckptfs_pickle_test_pwned'\nios\nsystem\n."s);
  EXPECT_EQ(inst.code(), Status::Code::kNotSupported);
  EXPECT_NE(inst.message().find("offset 40: INST is refused"), std::string::npos) << inst.message();
  Status obj = UnpickleError("(cos\nsystem\nS'touch /tmp/ckptfs_pickle_test_pwned'\no."s);
  EXPECT_EQ(obj.code(), Status::Code::kNotSupported);
  EXPECT_NE(obj.message().find("OBJ is refused"), std::string::npos) << obj.message();
  Status buf = UnpickleError("\x80\x05\x97."s);
  EXPECT_EQ(buf.code(), Status::Code::kNotSupported);
}

TEST_F(PickleHostileTest, UnknownOpcodeAndProtocol) {
  EXPECT_EQ(UnpickleError("\x80\x02\xff."s).message(), "pickle: offset 2: unknown opcode 0xff");
  EXPECT_EQ(UnpickleError("\x80\x06N."s).message(), "pickle: offset 0: PROTO protocol 6 is newer than 5");
}

TEST_F(PickleHostileTest, MemoConfusion) {
  EXPECT_EQ(UnpickleError("\x80\x02h\x05."s).message(), "pickle: offset 2: BINGET memo index 5 is unset");
  EXPECT_EQ(UnpickleError("\x80\x02j\x00\x00\x00\x10."s).message(),
            "pickle: offset 2: LONG_BINGET memo index 268435456 is unset");
  EXPECT_EQ(UnpickleError("g7\n."s).message(), "pickle: offset 0: GET memo index 7 is unset");
  EXPECT_EQ(UnpickleError("\x80\x02q\x00N."s).message(),
            "pickle: offset 2: BINPUT needs a value on the stack (stack underflow)");
  EXPECT_EQ(UnpickleError("\x80\x04\x94N."s).message(),
            "pickle: offset 2: MEMOIZE needs a value on the stack (stack underflow)");
  // PUT may not reach below the current MARK (CPython's fence).
  EXPECT_EQ(UnpickleError("N(q\x00."s).message(), "pickle: offset 2: BINPUT needs a value on the stack (stack underflow)");
  EXPECT_EQ(UnpickleError("pX\n."s).message(), "pickle: offset 0: PUT argument is not a memo index");
}

TEST_F(PickleHostileTest, SparseMemoIndexAllocatesNothingLarge) {
  // LONG_BINPUT 4e9 must not size a vector to 4e9 entries.
  auto doc = MustUnpickle("\x80\x02K\x07r\x00\x28\x6b\xee""0j\x00\x28\x6b\xee."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().AsInt(), 7);
}

TEST_F(PickleHostileTest, StackUnderflowAndMarks) {
  EXPECT_EQ(UnpickleError("."s).message(), "pickle: offset 0: STOP needs a value on the stack (stack underflow)");
  EXPECT_EQ(UnpickleError("]K\x01(a."s).message(), "pickle: offset 4: APPEND needs a value on the stack (stack underflow)");
  EXPECT_EQ(UnpickleError("N1."s).message(), "pickle: offset 1: POP_MARK has no MARK to pop to");
  EXPECT_EQ(UnpickleError("N(K\x01u."s).message(), "pickle: offset 4: SETITEMS has an odd number of items (1)");
  EXPECT_EQ(UnpickleError("K\x01K\x02""a."s).message(), "pickle: offset 4: APPEND target is a int, not a list");
  EXPECT_EQ(UnpickleError("NN\x93."s).message(), "pickle: offset 2: STACK_GLOBAL needs two str values");
  // POP right after MARK discards the mark, as in CPython.
  auto doc = MustUnpickle("K\x01(0."s);
  ASSERT_TRUE(doc);
  EXPECT_EQ(doc->root().AsInt(), 1);
}

TEST_F(PickleHostileTest, DeepMarkNestingIsRefused) {
  std::string bytes(100'000, '(');
  bytes += ".";
  EXPECT_EQ(UnpickleError(bytes).message(), "pickle: offset 1000: MARK nesting exceeds the limit of 1000 marks");
}

TEST_F(PickleHostileTest, DeepListNestingIsRefused) {
  // 100k EMPTY_LISTs each appended into the one below: [[[[...]]]].
  std::string bytes(100'000, ']');
  bytes += std::string(99'999, 'a');
  bytes += ".";
  EXPECT_EQ(UnpickleError(bytes).message(), "pickle: values nest deeper than the limit of 1000");
}

TEST_F(PickleHostileTest, DeepNestingThroughTheMemoIsRefused) {
  // The stack stays two deep while the tree nests 100k levels: append a new
  // list to the previous one fetched from the memo. Destroying such a tree
  // must not recurse either (values are owned flat).
  std::string bytes = "\x80\x02]r\x00\x00\x00\x00"s;
  for (uint32_t i = 1; i <= 100'000; ++i) {
    auto le = [](uint32_t v) { return std::string{char(v), char(v >> 8), char(v >> 16), char(v >> 24)}; };
    bytes += "j" + le(i - 1) + "]r" + le(i) + "a0";
  }
  bytes += "j"s + std::string("\x00\x00\x00\x00", 4) + ".";
  EXPECT_EQ(UnpickleError(bytes).message(), "pickle: values nest deeper than the limit of 1000");
}

TEST_F(PickleHostileTest, ReferenceCycleIsRefused) {
  // L = []; L.append(L)
  EXPECT_EQ(UnpickleError("]q\x00h\x00""a."s).message(),
            "pickle: value refers to itself (reference cycle through the memo)");
  // d = {}; d['k'] = (d,)
  EXPECT_EQ(UnpickleError("}q\x00X\x01\x00\x00\x00kh\x00\x85s."s).message(),
            "pickle: value refers to itself (reference cycle through the memo)");
}

TEST_F(PickleHostileTest, ExponentialSharingIsRefused) {
  // x0 = []; x(i+1) = (x(i), x(i)): 60 levels is 2^61 values as a tree.
  std::string bytes = "]q\x00"s;
  for (int i = 0; i < 60; ++i) bytes += "h"s + char(i) + "h" + char(i) + "\x86q" + char(i + 1);
  bytes += ".";
  EXPECT_EQ(UnpickleError(bytes).message(),
            "pickle: value tree expands to more than 268435456 values through shared references");
}

TEST_F(PickleHostileTest, HugeDeclaredLengthsAreCheckedBeforeAllocating) {
  struct Case {
    std::string bytes;
    const char* message;
  } cases[] = {
      {"\x80\x04X\xff\xff\xff\xff""abcdefghijkl."s, "pickle: offset 2: BINUNICODE length 4294967295 exceeds remaining 13 bytes"},
      {"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f."s,
       "pickle: offset 2: BINUNICODE8 length 9223372036854775807 exceeds remaining 1 bytes"},
      {"\x80\x04\x8e\x00\x00\x00\x00\x01\x00\x00\x00."s, "pickle: offset 2: BINBYTES8 length 4294967296 exceeds remaining 1 bytes"},
      {"\x80\x05\x96\xff\xff\xff\xff\xff\xff\xff\xff."s,
       "pickle: offset 2: BYTEARRAY8 length 18446744073709551615 exceeds remaining 1 bytes"},
      {"\x80\x03""B\xff\xff\xff\x7f."s, "pickle: offset 2: BINBYTES length 2147483647 exceeds remaining 1 bytes"},
      {"\x80\x02T\xff\xff\xff\xff."s, "pickle: offset 2: BINSTRING byte count is negative"},
      {"\x80\x02\x8b\xff\xff\xff\x7f."s, "pickle: offset 2: LONG4 length 2147483647 exceeds remaining 1 bytes"},
      {"\x80\x02\x8b\xff\xff\xff\xff."s, "pickle: offset 2: LONG4 byte count is negative"},
      {"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xffN."s, "pickle: offset 2: FRAME length 18446744073709551615 exceeds remaining 2 bytes"},
      {"\x80\x04\x8c\x05""ab."s, "pickle: offset 2: SHORT_BINUNICODE length 5 exceeds remaining 3 bytes"},
  };
  for (const auto& c : cases) {
    Status s = UnpickleError(c.bytes);
    EXPECT_EQ(s.code(), Status::Code::kCorruption);
    EXPECT_EQ(s.message(), c.message);
  }
}

TEST_F(PickleHostileTest, LimitsHold) {
  UnpickleLimits lim;
  lim.max_string_bytes = 4;
  EXPECT_EQ(UnpickleError("\x80\x04\x8c\x05""abcde."s, lim).message(),
            "pickle: offset 2: SHORT_BINUNICODE length 5 exceeds the limit of 4 bytes");
  EXPECT_EQ(UnpickleError("Vabcdef\n."s, lim).message(), "pickle: offset 0: UNICODE line longer than the limit of 4 bytes");

  lim = {};
  lim.max_input_bytes = 3;
  EXPECT_EQ(UnpickleError("NNN."s, lim).message(), "pickle: input of 4 bytes exceeds the limit of 3");

  lim = {};
  lim.max_values = 3;
  EXPECT_EQ(UnpickleError("K\x01K\x02K\x03K\x04."s, lim).message(),
            "pickle: offset 6: BININT1 would create more than 3 values");

  lim = {};
  lim.max_memo_entries = 2;
  EXPECT_EQ(UnpickleError("Nq\x00q\x01q\x00q\x02."s, lim).message(), "pickle: offset 7: BINPUT memo exceeds 2 entries");

  lim = {};
  lim.max_container_length = 3;
  EXPECT_EQ(UnpickleError("NNNN."s, lim).message(), "pickle: offset 3: NONE stack exceeds 3 values");
  EXPECT_EQ(UnpickleError("]NaNaNaNa."s, lim).message(),
            "pickle: offset 8: APPEND container grows past the limit of 3 items");

  lim = {};
  lim.max_bigint_bytes = 8;
  EXPECT_EQ(UnpickleError("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."s, lim).message(),
            "pickle: offset 0: LONG1 integer of 9 bytes exceeds the limit of 8");
}

TEST_F(PickleHostileTest, InvalidUtf8IsRefused) {
  EXPECT_EQ(UnpickleError("\x80\x04\x8c\x02\xc3\x28."s).message(), "pickle: offset 2: SHORT_BINUNICODE string is not valid UTF-8");
  EXPECT_EQ(UnpickleError("\x80\x04\x8c\x03\xed\xa0\x80."s).message(),  // lone surrogate
            "pickle: offset 2: SHORT_BINUNICODE string is not valid UTF-8");
  EXPECT_EQ(UnpickleError("c\xff\nx\n."s).message(), "pickle: offset 0: GLOBAL name is not valid UTF-8");
}

TEST_F(PickleHostileTest, EveryTruncationOfARealPickleFails) {
  for (const std::string& full : kMixed) {
    for (size_t n = 0; n < full.size(); ++n) {
      Status s = UnpickleError(full.substr(0, n));
      EXPECT_EQ(s.code(), Status::Code::kCorruption) << "prefix " << n;
    }
  }
  EXPECT_EQ(UnpickleError("\x80\x04\x8c"s).message(),
            "pickle: offset 2: SHORT_BINUNICODE argument of 1 bytes exceeds remaining 0 bytes");
  EXPECT_EQ(UnpickleError("\x80\x04\x8c\x05"s).message(),
            "pickle: offset 2: SHORT_BINUNICODE length 5 exceeds remaining 0 bytes");
  EXPECT_EQ(UnpickleError(""s).message(), "pickle: offset 0: input ends before the STOP opcode (truncated)");
  EXPECT_EQ(UnpickleError("I12"s).message(), "pickle: offset 0: INT line is not terminated before the end of input");
}

TEST(PickleAllowlistTest, KnownTorchAndDcpNames) {
  EXPECT_TRUE(IsAllowedGlobal("torch._utils", "_rebuild_tensor_v2"));
  EXPECT_TRUE(IsAllowedGlobal("torch._utils", "_rebuild_tensor_v3"));
  EXPECT_TRUE(IsAllowedGlobal("torch", "BFloat16Storage"));
  EXPECT_TRUE(IsAllowedGlobal("torch.storage", "UntypedStorage"));
  EXPECT_TRUE(IsAllowedGlobal("torch", "bfloat16"));
  EXPECT_TRUE(IsAllowedGlobal("torch", "float8_e4m3fn"));
  EXPECT_TRUE(IsAllowedGlobal("torch", "Size"));
  EXPECT_TRUE(IsAllowedGlobal("collections", "OrderedDict"));
  EXPECT_TRUE(IsAllowedGlobal("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"));
  EXPECT_TRUE(IsAllowedGlobal("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"));
  EXPECT_TRUE(IsAllowedGlobal("torch.distributed.checkpoint.filesystem", "_StorageInfo"));
  EXPECT_TRUE(IsAllowedGlobal("pathlib", "PosixPath"));
  EXPECT_TRUE(IsAllowedGlobal("_codecs", "encode"));
  EXPECT_FALSE(IsAllowedGlobal("torch.distributed.checkpoint.filesystem", "FileSystemReader"));
  EXPECT_FALSE(IsAllowedGlobal("torch.distributed.checkpoint.metadata.evil", "x"));
  EXPECT_FALSE(IsAllowedGlobal("torch", "load"));
  EXPECT_FALSE(IsAllowedGlobal("os", "system"));
  EXPECT_FALSE(IsAllowedGlobal("builtins", "eval"));
  EXPECT_FALSE(IsAllowedGlobal("torch.storage", "_load_from_bytes"));  // a nested torch.load
}

// ---------------------------------------------------------------------------
// DCP metadata read from the inert tree (indexer/dcp_metadata.h). The pickles
// are torch 2.13's `pickle.dumps(Metadata(...), protocol=2)` of float32
// tensors, in hex; expected shapes are the ones given to torch.

std::string FromHex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(char(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

// {"w_a": [4]}
const char* kMetadataWa4 =
    "800263746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a4d657461646174610a"
    "7100298171017d710228581300000073746174655f646963745f6d6574616461746171037d71045803000000775f61710563"
    "746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a54656e736f7253746f726167"
    "654d657461646174610a7106298171077d710828580a00000070726f70657274696573710963746f7263682e646973747269"
    "62757465642e636865636b706f696e742e6d657461646174610a54656e736f7250726f706572746965730a710a2981710b28"
    "63746f7263680a666c6f617433320a710c63746f7263682e73657269616c697a6174696f6e0a5f6765745f6c61796f75740a"
    "710d580d000000746f7263682e73747269646564710e85710f5271108963746f7263682e64697374726962757465642e6368"
    "65636b706f696e742e6d657461646174610a5f4d454d5f464f524d41545f454e434f44494e470a71114b0085711252711389"
    "74711462580400000073697a65711563746f7263680a53697a650a71164b0485711785711852711958060000006368756e6b"
    "73711a5d711b63746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a4368756e6b"
    "53746f726167654d657461646174610a711c2981711d7d711e2858070000006f666673657473711f68164b00857120857121"
    "527122580500000073697a6573712368164b04857124857125527126756261756273580c000000706c616e6e65725f646174"
    "6171274e580c00000073746f726167655f6461746171287d7129580c00000073746f726167655f6d657461712a4e58070000"
    "0076657273696f6e712b4e75622e";
// {"w_a": [2, 2]}
const char* kMetadataWa2x2 =
    "800263746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a4d657461646174610a"
    "7100298171017d710228581300000073746174655f646963745f6d6574616461746171037d71045803000000775f61710563"
    "746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a54656e736f7253746f726167"
    "654d657461646174610a7106298171077d710828580a00000070726f70657274696573710963746f7263682e646973747269"
    "62757465642e636865636b706f696e742e6d657461646174610a54656e736f7250726f706572746965730a710a2981710b28"
    "63746f7263680a666c6f617433320a710c63746f7263682e73657269616c697a6174696f6e0a5f6765745f6c61796f75740a"
    "710d580d000000746f7263682e73747269646564710e85710f5271108963746f7263682e64697374726962757465642e6368"
    "65636b706f696e742e6d657461646174610a5f4d454d5f464f524d41545f454e434f44494e470a71114b0085711252711389"
    "74711462580400000073697a65711563746f7263680a53697a650a71164b024b028671178571185271195806000000636875"
    "6e6b73711a5d711b63746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a436875"
    "6e6b53746f726167654d657461646174610a711c2981711d7d711e2858070000006f666673657473711f68164b004b008671"
    "20857121527122580500000073697a6573712368164b024b02867124857125527126756261756273580c000000706c616e6e"
    "65725f6461746171274e580c00000073746f726167655f6461746171287d7129580c00000073746f726167655f6d65746171"
    "2a4e580700000076657273696f6e712b4e75622e";
// {"w_a": [4], "w_b": [2, 2]} with "w_b" renamed "w_a" in the bytes: one
// key twice, with chunk boxes of different rank.
const char* kMetadataWaTwice =
    "800263746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a4d657461646174610a"
    "7100298171017d710228581300000073746174655f646963745f6d6574616461746171037d7104285803000000775f617105"
    "63746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a54656e736f7253746f7261"
    "67654d657461646174610a7106298171077d710828580a00000070726f70657274696573710963746f7263682e6469737472"
    "6962757465642e636865636b706f696e742e6d657461646174610a54656e736f7250726f706572746965730a710a2981710b"
    "2863746f7263680a666c6f617433320a710c63746f7263682e73657269616c697a6174696f6e0a5f6765745f6c61796f7574"
    "0a710d580d000000746f7263682e73747269646564710e85710f5271108963746f7263682e64697374726962757465642e63"
    "6865636b706f696e742e6d657461646174610a5f4d454d5f464f524d41545f454e434f44494e470a71114b00857112527113"
    "8974711462580400000073697a65711563746f7263680a53697a650a71164b0485711785711852711958060000006368756e"
    "6b73711a5d711b63746f7263682e64697374726962757465642e636865636b706f696e742e6d657461646174610a4368756e"
    "6b53746f726167654d657461646174610a711c2981711d7d711e2858070000006f666673657473711f68164b008571208571"
    "21527122580500000073697a6573712368164b0485712485712552712675626175625803000000775f617127680629817128"
    "7d7129286809680a2981712a28680c68108968138974712b62681568164b024b0286712c85712d52712e681a5d712f681c29"
    "8171307d713128681f68164b004b00867132857133527134682368164b024b02867135857136527137756261756275580c00"
    "0000706c616e6e65725f6461746171384e580c00000073746f726167655f6461746171397d713a580c00000073746f726167"
    "655f6d657461713b4e580700000076657273696f6e713c4e75622e";

struct DcpMaps {
  std::map<std::string, TensorMeta> tensors;
  std::map<std::string, std::vector<Box>> declared;
  std::map<ChunkKey, StorageInfo> storage;
  std::map<std::string, StorageInfo> byte_storage;
  std::map<std::string, std::vector<uint64_t>> reformulated;
  Status Read(const std::string& rel, const char* hex) {
    auto doc = Unpickle(FromHex(hex));
    if (!doc.ok()) return doc.status();
    docs.push_back(std::move(*doc));
    return ReadDcpMetadata(rel, &docs.back()->root(), tensors, declared, storage, byte_storage, reformulated, nullptr);
  }
  std::vector<std::unique_ptr<const PickleDocument>> docs;
};

TEST(DcpMetadataTest, ReadsTheTensorTorchDeclared) {
  DcpMaps m;
  ASSERT_TRUE(m.Read(".metadata", kMetadataWa4).ok());
  ASSERT_EQ(m.tensors.count("w_a"), 1u);
  EXPECT_EQ(m.tensors["w_a"].shape, (std::vector<uint64_t>{4}));
  EXPECT_EQ(m.tensors["w_a"].dtype, DType::kF32);
  ASSERT_EQ(m.declared["w_a"].size(), 1u);
  EXPECT_EQ(m.declared["w_a"][0].lengths, (std::vector<uint64_t>{4}));
}

// Regression (found by dcp_metadata_fuzz): a key repeated in
// state_dict_metadata gave one tensor chunk boxes of two ranks.
TEST(DcpMetadataTest, TensorDeclaredTwiceInOneFileIsRefused) {
  DcpMaps m;
  Status st = m.Read(".metadata", kMetadataWaTwice);
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_NE(st.message().find("'w_a' appears twice in state_dict_metadata"), std::string::npos) << st.message();
}

TEST(DcpMetadataTest, PerRankFilesThatDisagreeOnAShapeAreRefused) {
  DcpMaps m;
  ASSERT_TRUE(m.Read("__0.metadata", kMetadataWa4).ok());
  EXPECT_TRUE(m.Read("__0_again.metadata", kMetadataWa4).ok());  // agreeing files are fine
  Status st = m.Read("__1.metadata", kMetadataWa2x2);
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_NE(st.message().find("__1.metadata: tensor 'w_a' is F32[2, 2] here but F32[4] in another metadata file"),
            std::string::npos)
      << st.message();
}

}  // namespace
}  // namespace ckptfs
