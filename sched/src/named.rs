//! [`named_enum!`](crate::named_enum): fieldless enums whose variants have names on the command
//! line — the policies, systems, dispatches and solvers the binaries take by name.

/// Defines a fieldless `Copy` enum whose variants have command-line names, with:
/// `ALL` (every variant, in declaration order), `name()`, `Display` (the name) and `FromStr`
/// (from the name; the error names what was asked for and lists every name).
///
/// ```
/// cascade_sched::named_enum! {
///     /// A colour.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Colour("colour") {
///         /// Red.
///         Red = "red",
///         /// Dark blue.
///         DarkBlue = "dark-blue",
///     }
/// }
/// assert_eq!("dark-blue".parse::<Colour>(), Ok(Colour::DarkBlue));
/// assert_eq!(Colour::ALL, [Colour::Red, Colour::DarkBlue]);
/// assert_eq!(Colour::Red.to_string(), "red");
/// assert_eq!("green".parse::<Colour>(), Err(r#"unknown colour "green" (red, dark-blue)"#.to_string()));
/// ```
#[macro_export]
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$($text),+].len()] = [$($name::$variant),+];

            /// Its name on the command line (what `FromStr` reads and `Display` writes).
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = ::std::string::String;
            fn from_str(s: &str) -> ::std::result::Result<Self, ::std::string::String> {
                Self::ALL.into_iter().find(|x| x.name() == s).ok_or_else(|| {
                    let names: ::std::vec::Vec<&str> = Self::ALL.iter().map(|x| x.name()).collect();
                    ::std::format!("unknown {} {s:?} ({})", $what, names.join(", "))
                })
            }
        }
    };
}
