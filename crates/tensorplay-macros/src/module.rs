//! `#[derive(Module)]`: a module's traversal (`ModuleFields`) written from its fields.
//!
//! Each named field is one of:
//! - the **core**: the one field of type `ModuleCore`;
//! - a **parameter**: a `Tensor` or `Option<Tensor>` (listed only when `Some`);
//! - a **buffer**: the same types marked `#[module(buffer)]`;
//! - **plain data**, left out: numbers, `bool`, `char`, `String`, `PhantomData`, and
//!   `Option`s, `Vec`s, arrays, tuples and references of them;
//! - **skipped**: any field marked `#[module(skip)]`;
//! - a **child module**: any other type, or an `Option` of one (listed only when `Some`); a
//!   `ModuleList` is a child like any other module. The type must implement `Module`.
//!
//! Names are the field names; parameters, buffers and children are listed in field order.

use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, GenericArgument, LitStr, PathArguments, Type};

/// What a field is to the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Core,
    Param,
    Buffer,
    Child,
    Skip,
}

/// The `#[module(...)]` marks of one field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Param,
    Buffer,
    Skip,
}

/// One field the expansion lists.
struct Field<'a> {
    ident: &'a syn::Ident,
    ty: &'a Type,
    role: Role,
    /// `Some(inner)` when the field is an `Option` of a tensor or a module.
    optional: Option<&'a Type>,
}

/// The last path segment of `ty` when it is a plain path type (`a::b::Name<..>`).
fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_segment(&g.elem),
        Type::Paren(p) => last_segment(&p.elem),
        _ => None,
    }
}

/// Whether `ty` is a path ending in `name` without generic arguments.
fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_empty())
}

/// The only type argument of `ty` when it is `name<T>`.
fn generic_arg<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let seg = last_segment(ty)?;
    if seg.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let first = types.next()?;
    types.next().is_none().then_some(first)
}

const PLAIN: &[&str] = &[
    "bool", "char", "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128",
    "isize", "f32", "f64", "String", "str",
];

/// Whether `ty` is plain data that can never hold a module or a parameter.
fn is_plain(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) => is_plain(&r.elem),
        Type::Array(a) => is_plain(&a.elem),
        Type::Slice(s) => is_plain(&s.elem),
        Type::Tuple(t) => t.elems.iter().all(is_plain),
        Type::Group(g) => is_plain(&g.elem),
        Type::Paren(p) => is_plain(&p.elem),
        Type::Path(_) => {
            if last_segment(ty).is_some_and(|s| s.ident == "PhantomData") {
                return true;
            }
            if PLAIN.iter().any(|n| is_named(ty, n)) {
                return true;
            }
            ["Option", "Vec", "Box"]
                .iter()
                .any(|w| generic_arg(ty, w).is_some_and(is_plain))
        }
        _ => false,
    }
}

/// The `#[module(...)]` mark of a field, if any.
fn field_mark(field: &syn::Field) -> syn::Result<Option<Mark>> {
    let mut mark = None;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            let m = if meta.path.is_ident("param") {
                Mark::Param
            } else if meta.path.is_ident("buffer") {
                Mark::Buffer
            } else if meta.path.is_ident("skip") {
                Mark::Skip
            } else {
                return Err(meta.error(
                    "unknown field option: expected `param`, `buffer` or `skip` \
                     (`crate = \"..\"` goes on the struct)",
                ));
            };
            if mark.is_some() {
                return Err(meta.error("a field takes one of `param`, `buffer` or `skip`"));
            }
            mark = Some(m);
            Ok(())
        })?;
    }
    Ok(mark)
}

/// Classifies one named field.
fn classify(field: &syn::Field) -> syn::Result<Field<'_>> {
    let ident = field
        .ident
        .as_ref()
        .ok_or_else(|| syn::Error::new_spanned(field, "#[derive(Module)] needs named fields"))?;
    let ty = &field.ty;
    let mark = field_mark(field)?;
    let tensor_in_option = generic_arg(ty, "Option").filter(|t| is_named(t, "Tensor"));
    let is_tensor = is_named(ty, "Tensor") || tensor_in_option.is_some();
    let (role, optional) = match mark {
        Some(Mark::Skip) => (Role::Skip, None),
        Some(m @ (Mark::Param | Mark::Buffer)) => {
            if !is_tensor {
                return Err(syn::Error::new_spanned(
                    ty,
                    "#[module(param)] and #[module(buffer)] mark a `Tensor` or `Option<Tensor>` field",
                ));
            }
            let role = if m == Mark::Param {
                Role::Param
            } else {
                Role::Buffer
            };
            (role, tensor_in_option)
        }
        None if is_named(ty, "ModuleCore") => (Role::Core, None),
        None if is_tensor => (Role::Param, tensor_in_option),
        None if is_plain(ty) => (Role::Skip, None),
        None => {
            if generic_arg(ty, "Vec").is_some() || matches!(ty, Type::Array(_) | Type::Slice(_)) {
                return Err(syn::Error::new_spanned(
                    ty,
                    "#[derive(Module)] does not traverse a Vec or an array: hold child modules \
                     in an `nn::ModuleList`, or mark the field #[module(skip)]",
                ));
            }
            if !matches!(ty, Type::Path(_) | Type::Group(_) | Type::Paren(_)) {
                return Err(syn::Error::new_spanned(
                    ty,
                    "#[derive(Module)] cannot list this field's type: a child module is a named \
                     type (or an `Option` of one); mark other fields #[module(skip)]",
                ));
            }
            (Role::Child, generic_arg(ty, "Option"))
        }
    };
    Ok(Field {
        ident,
        ty,
        role,
        optional,
    })
}

/// The crate root the generated code names (`::tensorplay_core` or `::tensorplay`), from
/// `#[module(crate = "path")]` or the caller's dependencies.
fn root_path(input: &DeriveInput) -> syn::Result<TokenStream2> {
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("module")) {
        let mut root = None;
        attr.parse_nested_meta(|meta| {
            if !meta.path.is_ident("crate") {
                return Err(meta.error("expected `crate = \"path\"` on the struct"));
            }
            let s: LitStr = meta.value()?.parse()?;
            let p: syn::Path = s.parse()?;
            root = Some(if p.is_ident("crate") {
                p.into_token_stream()
            } else {
                quote!(::#p)
            });
            Ok(())
        })?;
        if let Some(r) = root {
            return Ok(r);
        }
    }
    use proc_macro_crate::{FoundCrate, crate_name};
    let found = |name: &str| match crate_name(name) {
        // inside tensorplay-core (`extern crate self as tensorplay_core;`), its tests and examples
        Ok(FoundCrate::Itself) => Some(name.replace('-', "_")),
        Ok(FoundCrate::Name(n)) => Some(n),
        Err(_) => None,
    };
    let name = found("tensorplay-core")
        .or_else(|| found("tensorplay"))
        .unwrap_or_else(|| "tensorplay".to_string());
    let ident = syn::Ident::new(&name, Span::call_site());
    Ok(quote!(::#ident))
}

/// Whether `ty` names one of the struct's type parameters.
fn mentions(ty: &Type, params: &[&syn::Ident]) -> bool {
    ty.to_token_stream().into_iter().any(|tt| match tt {
        proc_macro2::TokenTree::Ident(i) => params.iter().any(|p| **p == i),
        _ => false,
    })
}

/// Expands `#[derive(Module)]` on `input`.
pub(crate) fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let named = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(f) => &f.named,
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "#[derive(Module)] needs named fields (they name the parameters)",
                ));
            }
        },
        _ => {
            return Err(syn::Error::new(
                input.ident.span(),
                "#[derive(Module)] works on structs with named fields",
            ));
        }
    };
    let root = root_path(input)?;
    let mut errors: Option<syn::Error> = None;
    let mut fields = Vec::new();
    for f in named {
        match classify(f) {
            Ok(c) => fields.push(c),
            Err(e) => match &mut errors {
                Some(all) => all.combine(e),
                None => errors = Some(e),
            },
        }
    }
    if let Some(e) = errors {
        return Err(e);
    }
    let cores: Vec<&Field> = fields.iter().filter(|f| f.role == Role::Core).collect();
    let core = match cores.as_slice() {
        [one] => one.ident,
        [] => {
            return Err(syn::Error::new(
                input.ident.span(),
                "#[derive(Module)] needs a field of type `ModuleCore` (the training flag and hooks)",
            ));
        }
        [_, second, ..] => {
            return Err(syn::Error::new_spanned(
                second.ty,
                "a module has one `ModuleCore` field; mark the others #[module(skip)]",
            ));
        }
    };

    let tensors = |role: Role, mutable: bool| -> Vec<TokenStream2> {
        fields
            .iter()
            .filter(|f| f.role == role)
            .map(|f| {
                let id = f.ident;
                let name = id.to_string();
                let pair = |v: TokenStream2| quote!((::std::string::String::from(#name), #v));
                match (f.optional.is_some(), mutable) {
                    (false, false) => {
                        let p = pair(quote!(::core::clone::Clone::clone(&self.#id)));
                        quote!(::core::option::Option::Some(#p))
                    }
                    (false, true) => {
                        let p = pair(quote!(&mut self.#id));
                        quote!(::core::option::Option::Some(#p))
                    }
                    (true, false) => {
                        let p = pair(quote!(::core::clone::Clone::clone(t)));
                        quote!(self.#id.as_ref().map(|t| #p))
                    }
                    (true, true) => {
                        let p = pair(quote!(t));
                        quote!(self.#id.as_mut().map(|t| #p))
                    }
                }
            })
            .collect()
    };
    let children = |mutable: bool| -> Vec<TokenStream2> {
        fields
            .iter()
            .filter(|f| f.role == Role::Child)
            .map(|f| {
                let id = f.ident;
                let name = id.to_string();
                let span = f.optional.unwrap_or(f.ty).span();
                let dyn_ty = if mutable {
                    quote_spanned!(span=> &mut dyn #root::nn::Module)
                } else {
                    quote_spanned!(span=> &dyn #root::nn::Module)
                };
                let cast = |v: TokenStream2| quote_spanned!(span=> #v as #dyn_ty);
                let pair = |v: TokenStream2| quote!((::std::string::String::from(#name), #v));
                match (f.optional.is_some(), mutable) {
                    (false, false) => {
                        let p = pair(cast(quote!(&self.#id)));
                        quote!(::core::option::Option::Some(#p))
                    }
                    (false, true) => {
                        let p = pair(cast(quote!(&mut self.#id)));
                        quote!(::core::option::Option::Some(#p))
                    }
                    (true, false) => {
                        let p = pair(cast(quote!(m)));
                        quote!(self.#id.as_ref().map(|m| #p))
                    }
                    (true, true) => {
                        let p = pair(cast(quote!(m)));
                        quote!(self.#id.as_mut().map(|m| #p))
                    }
                }
            })
            .collect()
    };
    let list = |items: Vec<TokenStream2>| quote!([#(#items),*].into_iter().flatten().collect());
    let tensor = quote!(#root::Tensor);
    let mut methods = Vec::new();
    for (role, get, get_mut) in [
        (
            Role::Param,
            quote!(local_parameters),
            quote!(local_parameters_mut),
        ),
        (
            Role::Buffer,
            quote!(local_buffers),
            quote!(local_buffers_mut),
        ),
    ] {
        let own = tensors(role, false);
        if own.is_empty() {
            continue;
        }
        let (own, own_mut) = (list(own), list(tensors(role, true)));
        methods.push(quote! {
            fn #get(&self) -> ::std::vec::Vec<(::std::string::String, #tensor)> {
                #own
            }
            fn #get_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #tensor)> {
                #own_mut
            }
        });
    }
    let kids = children(false);
    if !kids.is_empty() {
        let (kids, kids_mut) = (list(kids), list(children(true)));
        methods.push(quote! {
            fn named_children(&self)
                -> ::std::vec::Vec<(::std::string::String, &dyn #root::nn::Module)> {
                #kids
            }
            fn named_children_mut(&mut self)
                -> ::std::vec::Vec<(::std::string::String, &mut dyn #root::nn::Module)> {
                #kids_mut
            }
        });
    }

    // a child whose type names a type parameter must be a module
    let params: Vec<&syn::Ident> = input.generics.type_params().map(|p| &p.ident).collect();
    let mut generics = input.generics.clone();
    for f in fields.iter().filter(|f| f.role == Role::Child) {
        let ty = f.optional.unwrap_or(f.ty);
        if mentions(ty, &params) {
            generics
                .make_where_clause()
                .predicates
                .push(syn::parse_quote!(#ty: #root::nn::Module));
        }
    }
    let (impl_g, ty_g, where_g) = generics.split_for_impl();
    let name = &input.ident;
    Ok(quote! {
        #[automatically_derived]
        impl #impl_g #root::nn::ModuleFields for #name #ty_g #where_g {
            fn core(&self) -> &#root::nn::ModuleCore {
                &self.#core
            }
            fn core_mut(&mut self) -> &mut #root::nn::ModuleCore {
                &mut self.#core
            }
            #(#methods)*
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A derive input and the error text expected, or `None` for an expansion that succeeds
    /// and lists `expect_in_output`.
    struct Case {
        name: &'static str,
        input: &'static str,
        error: Option<&'static str>,
        expect_in_output: &'static [&'static str],
    }

    fn check(case: &Case) {
        let input: DeriveInput = syn::parse_str(case.input)
            .unwrap_or_else(|e| panic!("case {}: bad test input: {e}", case.name));
        match (expand(&input), case.error) {
            (Ok(out), None) => {
                let text = out.to_string();
                for want in case.expect_in_output {
                    assert!(
                        text.contains(want),
                        "case {}: {want:?} missing from {text}",
                        case.name
                    );
                }
            }
            (Err(e), Some(want)) => assert!(
                e.to_string().contains(want),
                "case {}: error {e:?} does not contain {want:?}",
                case.name
            ),
            (Ok(out), Some(want)) => {
                panic!("case {}: expected the error {want:?}, got {out}", case.name)
            }
            (Err(e), None) => panic!("case {}: unexpected error {e}", case.name),
        }
    }

    #[test]
    fn expansions_and_errors() {
        let cases = [
            Case {
                name: "parameters, an optional one, a child, plain data",
                input: "struct L { weight: Tensor, bias: Option<Tensor>, out: Linear, \
                        heads: usize, shape: Vec<usize>, core: ModuleCore }",
                error: None,
                expect_in_output: &[
                    "fn local_parameters",
                    "String :: from (\"weight\")",
                    "self . bias . as_ref ()",
                    "fn named_children",
                    "String :: from (\"out\")",
                    "& self . core",
                ],
            },
            Case {
                name: "buffers, skip, optional child, explicit crate",
                input: "#[module(crate = \"my_core\")] struct L { #[module(buffer)] mean: Tensor, \
                        #[module(skip)] cache: Tensor, #[module(skip)] mode: Mode, \
                        extra: Option<Linear>, core: ModuleCore }",
                error: None,
                expect_in_output: &[
                    "impl :: my_core :: nn :: ModuleFields for L",
                    "fn local_buffers",
                    "String :: from (\"mean\")",
                    "self . extra . as_mut ()",
                ],
            },
            Case {
                name: "a generic child gets a Module bound",
                input: "struct W<M> { module: M, core: ModuleCore }",
                error: None,
                expect_in_output: &["where M : :: tensorplay :: nn :: Module"],
            },
            Case {
                name: "no core",
                input: "struct L { weight: Tensor }",
                error: Some("needs a field of type `ModuleCore`"),
                expect_in_output: &[],
            },
            Case {
                name: "two cores",
                input: "struct L { a: ModuleCore, b: ModuleCore }",
                error: Some("one `ModuleCore` field"),
                expect_in_output: &[],
            },
            Case {
                name: "tuple struct",
                input: "struct L(Tensor, ModuleCore);",
                error: Some("needs named fields"),
                expect_in_output: &[],
            },
            Case {
                name: "enum",
                input: "enum L { A, B }",
                error: Some("works on structs"),
                expect_in_output: &[],
            },
            Case {
                name: "buffer on a non-tensor",
                input: "struct L { #[module(buffer)] n: usize, core: ModuleCore }",
                error: Some("mark a `Tensor` or `Option<Tensor>` field"),
                expect_in_output: &[],
            },
            Case {
                name: "unknown option",
                input: "struct L { #[module(weight)] w: Tensor, core: ModuleCore }",
                error: Some("unknown field option"),
                expect_in_output: &[],
            },
            Case {
                name: "a Vec of modules",
                input: "struct L { layers: Vec<Linear>, core: ModuleCore }",
                error: Some("nn::ModuleList"),
                expect_in_output: &[],
            },
            Case {
                name: "a function pointer",
                input: "struct L { f: fn(usize) -> usize, core: ModuleCore }",
                error: Some("cannot list this field's type"),
                expect_in_output: &[],
            },
            Case {
                name: "two marks",
                input: "struct L { #[module(param, skip)] w: Tensor, core: ModuleCore }",
                error: Some("one of `param`, `buffer` or `skip`"),
                expect_in_output: &[],
            },
        ];
        for case in &cases {
            check(case);
        }
    }
}
