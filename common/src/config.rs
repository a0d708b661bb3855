//! What both binaries' configuration from the environment shares: the error that names the
//! variable, and the variable table their `--help` prints.

use std::fmt;

/// A configuration error: which variable, what value, and why. Shown on stderr, exit code 2.
#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}: {}", self.var, self.reason)
        } else {
            write!(f, "{}={:?}: {}", self.var, self.value, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

/// Appends one line per variable (name, default, meaning) of a `--help` text, the defaults in
/// a column `default_width` wide.
pub fn push_var_table(out: &mut String, vars: &[(&str, &str, &str)], default_width: usize) {
    for (name, default, meaning) in vars {
        out.push_str(&format!("  {name:<18} {default:<default_width$} {meaning}\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_names_the_variable_and_quotes_its_value() {
        let e = ConfigError { var: "PORT", value: "x".into(), reason: "not a number".into() };
        assert_eq!(e.to_string(), r#"PORT="x": not a number"#);
        let e = ConfigError { var: "TOKEN", value: String::new(), reason: "is required".into() };
        assert_eq!(e.to_string(), "TOKEN: is required");
    }

    #[test]
    fn the_table_aligns_defaults() {
        let mut out = String::new();
        push_var_table(&mut out, &[("A", "1", "one"), ("LONGER", "22", "two")], 4);
        assert_eq!(out, "  A                  1    one\n  LONGER             22   two\n");
    }
}
