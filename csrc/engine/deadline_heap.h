// An indexed binary min-heap of deadlines, ordered by (deadline, sequence number).
//
// Each node remembers its own position in the heap (`heap_index`), so removing an arbitrary node
// (a cancelled or dropped token) is O(log n) instead of a linear search. Equal deadlines are broken
// by the sequence number, so timers registered with the same deadline fire in registration order.
// The heap does not own its nodes and is not thread-safe: the engine guards it with its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "clock.h"

namespace fastdist {

constexpr std::size_t kNotInHeap = static_cast<std::size_t>(-1);

// Node must have members: Nanos deadline; std::uint64_t seq; std::size_t heap_index.
template <typename Node>
class DeadlineHeap {
 public:
  bool empty() const { return slots_.empty(); }
  std::size_t size() const { return slots_.size(); }
  Node* top() const { return slots_.front().node; }
  Nanos top_deadline() const { return empty() ? kNever : slots_.front().deadline; }

  void push(Node* node) {
    node->heap_index = slots_.size();
    slots_.push_back(Slot{node->deadline, node->seq, node});
    sift_up(node->heap_index);
  }

  // Removes `node` if it is in the heap; returns whether it was.
  bool erase(Node* node) {
    std::size_t i = node->heap_index;
    if (i == kNotInHeap) return false;
    node->heap_index = kNotInHeap;
    std::size_t last = slots_.size() - 1;
    if (i != last) {
      slots_[i] = slots_[last];
      slots_[i].node->heap_index = i;
      slots_.pop_back();
      // The moved slot may belong above or below its new position.
      if (i > 0 && less(slots_[i], slots_[parent(i)])) {
        sift_up(i);
      } else {
        sift_down(i);
      }
    } else {
      slots_.pop_back();
    }
    return true;
  }

  Node* pop() {
    Node* node = top();
    erase(node);
    return node;
  }

  void shrink_if_sparse() {
    if (slots_.capacity() > 1024 && slots_.size() < slots_.capacity() / 4) slots_.shrink_to_fit();
  }

 private:
  // The key is copied into the slot so that comparisons do not chase node pointers.
  struct Slot {
    Nanos deadline;
    std::uint64_t seq;
    Node* node;
  };

  static std::size_t parent(std::size_t i) { return (i - 1) / 2; }

  static bool less(const Slot& a, const Slot& b) {
    return a.deadline < b.deadline || (a.deadline == b.deadline && a.seq < b.seq);
  }

  void place(std::size_t i, const Slot& s) {
    slots_[i] = s;
    s.node->heap_index = i;
  }

  void sift_up(std::size_t i) {
    Slot moving = slots_[i];
    while (i > 0 && less(moving, slots_[parent(i)])) {
      place(i, slots_[parent(i)]);
      i = parent(i);
    }
    place(i, moving);
  }

  void sift_down(std::size_t i) {
    Slot moving = slots_[i];
    const std::size_t n = slots_.size();
    for (;;) {
      std::size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && less(slots_[child + 1], slots_[child])) ++child;
      if (!less(slots_[child], moving)) break;
      place(i, slots_[child]);
      i = child;
    }
    place(i, moving);
  }

  std::vector<Slot> slots_;
};

}  // namespace fastdist
