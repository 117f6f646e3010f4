"""Reference run of a collisionless id table's training, for
tests/dist_optim/id_table_parity_test.cpp: PyTorch 1.13's SGD, Adagrad and SparseAdam step the
live rows of one server's table while ids are admitted, expire and are evicted.

Usage: id_table_reference.py --out DIR --initial FILE --dim D --capacity C --admit-after K
                             --expire-after T --steps S --bags B --ids-per-bag P

FILE (written by the test) holds the id universe, a line per id: the id, then the D values of the
row a row handed to it starts at (the table's initial row, a function of the id and the seed that
only the library computes).

The table is modelled as the server holds it: storage of C + 1 rows, row 0 the default row (zeros)
that every id without a row reads and that no gradient moves; which row holds each id follows the
library's rules (src/rpc/id_rows.h), written again here from its documentation: an id gets a row
at its K-th sighting, a row not looked up for T lookups is dropped (checked every max(1, T // 8)
lookups), at the bound the least recently used row not used by the lookup at hand goes first
(ties: the lowest row), at most C ids are counted towards admission (at the bound the half seen
least recently are forgotten). A row handed to an id is set to the id's initial row, and its
optimizer state to a new parameter's (Adagrad's initial_accumulator_value, SparseAdam's zeros;
the step count stays). The storage is an nn.Parameter that PyTorch's optimizer steps with the
sparse gradient of F.embedding_bag (sum), in which an id without a row weighs 0.

Each step looks up B bags of P ids drawn from the universe with Zipf-like weights (a seeded
generator), and the loss is the sum of squares of the pooled rows less a random target.

Writes into DIR (torch.save of lists of tensors):
  scenario.pt              [ids (S, B, P) int64, targets (S, B, D) float64]
  expected_<optimizer>.pt  for each step s: [2s] the live ids after its step, ascending, and
                           [2s + 1] their rows; then [2S] the counters after the last step
                           (live rows, admitted, expired, evicted, lookups of the default row,
                           ids counted towards admission), [2S + 1] the optimizer's step count,
                           then its state buffers' rows of the live ids after the last step
                           (Adagrad: sum; SparseAdam: exp_avg, exp_avg_sq; SGD: none)
"""

import argparse
import os

import torch
import torch.nn.functional as F

# Keep in sync with the C++ test.
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(
        params, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-10),
    "sparse_adam": lambda params: torch.optim.SparseAdam(params, lr=0.05, betas=(0.9, 0.999),
                                                         eps=1e-8),
}
STATE_BUFFERS = {"sgd": [], "adagrad": ["sum"], "sparse_adam": ["exp_avg", "exp_avg_sq"]}
SCENARIO_SEED = 5
NO_ROW = -1


class IdRows:
    """Which slot of [0, capacity) holds each id (the storage's row is the slot + 1)."""

    def __init__(self, capacity, admit_after, expire_after):
        self.capacity = capacity
        self.admit_after = admit_after
        self.expire_after = expire_after
        self.max_pending = capacity
        self.row_of = {}
        self.pending = {}  # id -> [sightings, last seen]
        self.id_of = [0] * capacity
        self.live = [False] * capacity
        self.last_used = [0] * capacity
        self.free = list(range(capacity - 1, -1, -1))  # taken from the back: slot 0 first
        self.next_expiry = 0
        self.admitted = self.expired = self.evicted = self.unadmitted_lookups = 0

    def lookup(self, ids, now, on_assign):
        expiry_due = self.expire_after > 0 and now >= self.next_expiry
        if not expiry_due and all(i in self.row_of for i in ids):
            for i in ids:
                self.last_used[self.row_of[i]] = now
            return [self.row_of[i] for i in ids]
        if expiry_due:
            self.next_expiry = now + max(1, self.expire_after // 8)
            for slot in range(self.capacity):
                if self.live[slot] and self.last_used[slot] < now - self.expire_after:
                    self.drop(slot)
                    self.expired += 1
        slots = [NO_ROW] * len(ids)
        unknown = []
        for k, i in enumerate(ids):  # known ids first: admissions never evict them
            if i in self.row_of:
                slots[k] = self.row_of[i]
                self.last_used[slots[k]] = now
            else:
                unknown.append(k)
        for k in unknown:
            i = ids[k]
            if i in self.row_of:  # admitted earlier in this lookup
                slots[k] = self.row_of[i]
                continue
            slot = NO_ROW
            if self.sighted(i, now):
                slot = self.give(i, now)
                if slot != NO_ROW:
                    self.admitted += 1
                    on_assign(i, slot)
            if slot == NO_ROW:
                self.unadmitted_lookups += 1
            slots[k] = slot
        return slots

    def sighted(self, i, now):
        if self.admit_after == 1:
            return True
        if i not in self.pending:
            if len(self.pending) >= self.max_pending:
                seen = sorted((p[1], pending_id) for pending_id, p in self.pending.items())
                for _, pending_id in seen[:max(1, len(seen) // 2)]:
                    del self.pending[pending_id]
            self.pending[i] = [0, 0]
        entry = self.pending[i]
        entry[1] = now
        entry[0] += 1
        return entry[0] >= self.admit_after

    def give(self, i, now):
        if not self.free:
            candidates = sorted((self.last_used[slot], slot) for slot in range(self.capacity)
                                if self.live[slot] and self.last_used[slot] < now)
            count = min(len(candidates), max(1, self.capacity // 64))
            for _, slot in candidates[:count]:
                self.drop(slot)
            self.evicted += count
        if not self.free:
            return NO_ROW
        slot = self.free.pop()
        self.pending.pop(i, None)
        self.row_of[i] = slot
        self.id_of[slot] = i
        self.live[slot] = True
        self.last_used[slot] = now
        return slot

    def drop(self, slot):
        del self.row_of[self.id_of[slot]]
        self.live[slot] = False
        self.free.append(slot)

    def counters(self):
        return [len(self.row_of), self.admitted, self.expired, self.evicted,
                self.unadmitted_lookups, len(self.pending)]


def read_initial(path, dim):
    initial = {}
    universe = []
    with open(path) as lines:
        for line in lines:
            fields = line.split()
            assert len(fields) == dim + 1, "a line of %s has %d fields" % (path, len(fields))
            universe.append(int(fields[0]))
            initial[universe[-1]] = torch.tensor([float(v) for v in fields[1:]],
                                                 dtype=torch.float64)
    return universe, initial


def make_scenario(universe, args):
    generator = torch.Generator().manual_seed(SCENARIO_SEED)
    weights = torch.tensor([1.0 / (rank + 1) ** 1.1 for rank in range(len(universe))])
    picks = torch.multinomial(weights, args.steps * args.bags * args.ids_per_bag,
                              replacement=True, generator=generator)
    ids = torch.tensor(universe, dtype=torch.int64)[picks]
    ids = ids.reshape(args.steps, args.bags, args.ids_per_bag)
    targets = torch.randn(args.steps, args.bags, args.dim, generator=generator,
                          dtype=torch.float64)
    return ids, targets


def train(name, initial, ids, targets, args):
    weight = torch.nn.Parameter(torch.zeros(args.capacity + 1, args.dim, dtype=torch.float64))
    optimizer = OPTIMIZERS[name]([weight])
    defaults = optimizer.defaults
    table = IdRows(args.capacity, args.admit_after, args.expire_after)

    def on_assign(i, slot):
        with torch.no_grad():
            weight[slot + 1] = initial[i]
            state = optimizer.state[weight]
            if "sum" in state:
                state["sum"][slot + 1] = defaults["initial_accumulator_value"]
            for moment in ("exp_avg", "exp_avg_sq"):
                if moment in state:
                    state[moment][slot + 1] = 0

    out = []
    for step in range(args.steps):
        flat = ids[step].flatten().tolist()
        slots = table.lookup(flat, step + 1, on_assign)  # the shard's clock: a tick per lookup
        rows = torch.tensor([slot + 1 for slot in slots]).reshape(args.bags, args.ids_per_bag)
        weigh = torch.tensor([0.0 if slot == NO_ROW else 1.0 for slot in slots],
                             dtype=torch.float64).reshape(args.bags, args.ids_per_bag)
        pooled = F.embedding_bag(rows, weight, mode="sum", per_sample_weights=weigh, sparse=True)
        optimizer.zero_grad()
        ((pooled - targets[step]) ** 2).sum().backward()
        optimizer.step()
        live = sorted(table.row_of)
        live_rows = torch.tensor([table.row_of[i] + 1 for i in live], dtype=torch.int64)
        out.append(torch.tensor(live, dtype=torch.int64))
        out.append(weight.detach()[live_rows].clone())
    out.append(torch.tensor(table.counters(), dtype=torch.int64))
    state = optimizer.state[weight]
    out.append(torch.tensor([int(state["step"]) if "step" in state else 0], dtype=torch.int64))
    for buffer in STATE_BUFFERS[name]:
        out.append(state[buffer][live_rows].clone())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--initial", required=True)
    for option in ("dim", "capacity", "admit-after", "expire-after", "steps", "bags",
                   "ids-per-bag"):
        parser.add_argument("--" + option, type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    universe, initial = read_initial(args.initial, args.dim)
    ids, targets = make_scenario(universe, args)
    torch.save([ids, targets], os.path.join(args.out, "scenario.pt"))
    for name in OPTIMIZERS:
        expected = train(name, initial, ids, targets, args)
        torch.save(expected, os.path.join(args.out, "expected_%s.pt" % name))
        print("%s: counters after the last step %s" % (name, expected[2 * args.steps].tolist()))


if __name__ == "__main__":
    main()
