// What the step ops (ops.cpp) and the SYCL host glue (kernels_xpu/host/module.cpp) share to read a call's arguments
// for any fused:: entry of optimizers.h: its scalars as the entry's Args, and the names of its state lists.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ipex_train {
namespace step_args {

// Converts to whatever field type it initializes; AnyField only counts the fields.
template <class Get>
struct Field {
  const Get& get;
  size_t k;
  template <class T>
  operator T() const {
    return get(k, T());
  }
};
struct AnyField {
  template <class T>
  operator T() const;
};

template <class A, class Seq, class = void>
struct Fits : std::false_type {};
template <class A, size_t... I>
struct Fits<A, std::index_sequence<I...>, std::void_t<decltype(A{(void(I), AnyField{})...})>> : std::true_type {};

// The number of fields of the aggregate A.
template <class A, size_t N = 0>
constexpr size_t field_count() {
  if constexpr (Fits<A, std::make_index_sequence<N + 1>>::value) return field_count<A, N + 1>();
  else return N;
}

template <class A, class Get, size_t... I>
A make(const Get& get, std::index_sequence<I...>) {
  return A{Field<Get>{get, I}...};
}

// Args (an optimizer's scalar arguments, as fields in schema order) from get(k, T()), the k-th scalar as a T.
template <class Args, class Get>
Args scalars(const Get& get) {
  return make<Args>(get, std::make_index_sequence<field_count<Args>()>());
}

// The optional members of an optimizer's Args: error() (a message, or null), states() (how many of its state lists
// this call uses) and variant() (which apply<V> it runs); by default no error, every state list and variant 0.
template <class A, class = void>
struct HasError : std::false_type {};
template <class A>
struct HasError<A, std::void_t<decltype(std::declval<const A&>().error())>> : std::true_type {};
template <class A, class = void>
struct HasStates : std::false_type {};
template <class A>
struct HasStates<A, std::void_t<decltype(std::declval<const A&>().states())>> : std::true_type {};
template <class A, class = void>
struct HasVariant : std::false_type {};
template <class A>
struct HasVariant<A, std::void_t<decltype(std::declval<const A&>().variant())>> : std::true_type {};

template <class Opt>
const char* error(const typename Opt::Args& a) {
  if constexpr (HasError<typename Opt::Args>::value) return a.error();
  else return nullptr;
}
template <class Opt>
int states(const typename Opt::Args& a) {
  if constexpr (HasStates<typename Opt::Args>::value) return a.states();
  else return Opt::kStates;
}
template <class Opt>
int variant(const typename Opt::Args& a) {
  if constexpr (HasVariant<typename Opt::Args>::value) return a.variant();
  else return 0;
}

// The names of the state lists (the mutable tensor lists, "Tensor(x!)[] name") of an ITR_OPTIMIZERS schema.
inline std::vector<std::string> state_names(const std::string& arguments) {
  std::vector<std::string> names;
  for (size_t begin = 0; begin < arguments.size();) {
    size_t end = arguments.find(", ", begin);
    if (end == std::string::npos) end = arguments.size();
    const std::string arg = arguments.substr(begin, end - begin);
    const size_t space = arg.find(' ');
    if (arg.rfind("Tensor(", 0) == 0 && arg.compare(space - 4, 4, "!)[]") == 0) names.push_back(arg.substr(space + 1));
    begin = end + 2;
  }
  return names;
}

}  // namespace step_args
}  // namespace ipex_train
