//! `#[interface]`: a trait as the method set of a `RemoteModule`.

use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{
    FnArg, GenericArgument, ItemTrait, LitStr, Pat, PathArguments, ReturnType, Token, TraitItem,
    Type,
};

/// One method of the interface.
struct Method {
    name: syn::Ident,
    mutable: bool,
    arg_names: Vec<syn::Ident>,
    arg_types: Vec<Type>,
    ret: Type,
    docs: Vec<syn::Attribute>,
}

fn runtime_path(attr: TokenStream2) -> syn::Result<syn::Path> {
    if attr.is_empty() {
        return Ok(syn::parse_quote!(::tensorplay::distributed::nn));
    }
    let metas = Punctuated::<syn::MetaNameValue, Token![,]>::parse_terminated.parse2(attr)?;
    let mut path: Option<syn::Path> = None;
    for m in metas {
        if !m.path.is_ident("crate") {
            return Err(syn::Error::new_spanned(
                &m.path,
                "expected `crate = \"path\"`",
            ));
        }
        let syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(s),
            ..
        }) = &m.value
        else {
            return Err(syn::Error::new_spanned(
                &m.value,
                "expected a string literal",
            ));
        };
        let s: &LitStr = s;
        let p: syn::Path = s.parse()?;
        path = Some(syn::parse_quote!(::#p));
    }
    path.ok_or_else(|| {
        syn::Error::new(
            proc_macro2::Span::call_site(),
            "expected `crate = \"path\"`",
        )
    })
}

/// The `R` of a `Result<R>` return type.
fn result_inner(ret: &ReturnType) -> syn::Result<Type> {
    let err = || {
        syn::Error::new_spanned(
            ret,
            "interface methods return Result<R> (the stack's Result) with R: Wire",
        )
    };
    let ReturnType::Type(_, ty) = ret else {
        return Err(err());
    };
    let Type::Path(tp) = &**ty else {
        return Err(err());
    };
    let last = tp.path.segments.last().ok_or_else(err)?;
    if last.ident != "Result" {
        return Err(err());
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return Err(err());
    };
    match args.args.first() {
        Some(GenericArgument::Type(t)) => Ok(t.clone()),
        _ => Err(err()),
    }
}

fn methods(t: &ItemTrait) -> syn::Result<Vec<Method>> {
    let mut out = Vec::new();
    for item in &t.items {
        let TraitItem::Fn(f) = item else {
            return Err(syn::Error::new_spanned(
                item,
                "an #[interface] trait holds only methods",
            ));
        };
        let sig = &f.sig;
        if !sig.generics.params.is_empty() || sig.asyncness.is_some() {
            return Err(syn::Error::new_spanned(
                sig,
                "interface methods are neither generic nor async",
            ));
        }
        let mut inputs = sig.inputs.iter();
        let mutable = match inputs.next() {
            Some(FnArg::Receiver(r)) if r.reference.is_some() => r.mutability.is_some(),
            _ => {
                return Err(syn::Error::new_spanned(
                    sig,
                    "interface methods take &self or &mut self",
                ));
            }
        };
        let mut arg_names = Vec::new();
        let mut arg_types = Vec::new();
        for (i, a) in inputs.enumerate() {
            let FnArg::Typed(pt) = a else {
                return Err(syn::Error::new_spanned(a, "unexpected receiver"));
            };
            let name = match &*pt.pat {
                Pat::Ident(id) => id.ident.clone(),
                _ => format_ident!("arg{i}"),
            };
            arg_names.push(name);
            arg_types.push((*pt.ty).clone());
        }
        out.push(Method {
            name: sig.ident.clone(),
            mutable,
            arg_names,
            arg_types,
            ret: result_inner(&sig.output)?,
            docs: f
                .attrs
                .iter()
                .filter(|a| a.path().is_ident("doc"))
                .cloned()
                .collect(),
        });
    }
    Ok(out)
}

pub(crate) fn expand(attr: TokenStream2, t: ItemTrait) -> syn::Result<TokenStream2> {
    let rt = runtime_path(attr)?;
    let ms = methods(&t)?;
    let vis = &t.vis;
    let name = &t.ident;
    let name_str = name.to_string();
    let remote = format_ident!("{}Remote", name);
    let marker = format_ident!("{}Interface", name);

    let mut remote_sigs = Vec::new();
    let mut remote_impls = Vec::new();
    let mut registrations = Vec::new();
    let mut method_list = Vec::new();
    for m in &ms {
        let mname = &m.name;
        let mname_str = mname.to_string();
        let async_name = format_ident!("{}_async", mname);
        let (an, at, ret) = (&m.arg_names, &m.arg_types, &m.ret);
        let docs = &m.docs;
        let doc_async = format!("[`{remote}::{mname}`] returning a future.");
        remote_sigs.push(quote! {
            #(#docs)*
            fn #mname(&self, #(#an: #at),*) -> #rt::__private::Result<#ret>;
            #[doc = #doc_async]
            fn #async_name(&self, #(#an: #at),*)
                -> #rt::__private::Result<#rt::__private::RpcFuture<#ret>>;
        });
        remote_impls.push(quote! {
            fn #mname(&self, #(#an: #at),*) -> #rt::__private::Result<#ret> {
                ::core::result::Result::Ok(self.#async_name(#(#an),*)?.wait()?)
            }
            fn #async_name(&self, #(#an: #at),*)
                -> #rt::__private::Result<#rt::__private::RpcFuture<#ret>> {
                self.__interface_call_async::<#marker, (#(#at,)*), #ret>(#mname_str, (#(#an,)*))
            }
        });
        let (lock, borrow) = if m.mutable {
            (quote!(write), quote!(&mut *guard))
        } else {
            (quote!(read), quote!(&*guard))
        };
        registrations.push(quote! {
            #rt::__private::register_method(
                &#rt::interface_method_name::<M>(#name_str, #mname_str),
                |h: &#rt::Hosted<M>, (#(#an,)*): (#(#at,)*)| -> #rt::__private::Result<#ret> {
                    #[allow(unused_mut)]
                    let mut guard = h.#lock();
                    <M as #name>::#mname(#borrow, #(#an),*)
                },
            );
        });
        method_list.push(quote! {
            (
                ::std::string::String::from(#mname_str),
                ::std::format!(
                    "({}) -> {}",
                    ::std::any::type_name::<(#(#at,)*)>(),
                    ::std::any::type_name::<#ret>()
                ),
            )
        });
    }
    let remote_doc = format!(
        "The remote forms of [`{name}`]'s methods on a `RemoteModule` (generated by `#[interface]`)."
    );
    let marker_doc = format!(
        "The interface [`{name}`] as a method set of `RemoteModule` (generated by `#[interface]`)."
    );
    Ok(quote! {
        #t

        #[doc = #remote_doc]
        #vis trait #remote {
            #(#remote_sigs)*
        }

        impl<M> #remote for #rt::RemoteModule<M>
        where
            M: #name + #rt::RemoteConstructible,
        {
            #(#remote_impls)*
        }

        #[doc = #marker_doc]
        #[derive(Debug, Clone, Copy)]
        #vis struct #marker;

        impl<M> #rt::Interface<M> for #marker
        where
            M: #name + #rt::RemoteConstructible,
        {
            const NAME: &'static str = #name_str;
            fn methods() -> ::std::vec::Vec<(::std::string::String, ::std::string::String)> {
                ::std::vec![#(#method_list),*]
            }
            fn register_methods() {
                #(#registrations)*
            }
        }
    })
}
