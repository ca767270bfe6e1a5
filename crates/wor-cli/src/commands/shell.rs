//! What a shell and `man` need: completion scripts and manual pages, generated from the same
//! command definitions that parse the arguments, so neither can drift from the binary.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::CommandFactory as _;

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManpagesArgs {
    /// The directory to write the pages into (created if missing): `wor.1`, and one page per
    /// subcommand such as `wor-routine-apply.1`.
    #[arg(value_name = "DIR")]
    dir: PathBuf,
}

/// Prints the completion script for `args.shell` on standard output.
pub fn completions(args: &CompletionsArgs) -> ExitCode {
    let mut command = crate::Cli::command();
    clap_complete::generate(args.shell, &mut command, "wor", &mut std::io::stdout());
    ExitCode::SUCCESS
}

/// Writes a manual page for `wor` and for every subcommand at any depth; prints each path.
pub fn manpages(args: &ManpagesArgs) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("cannot create `{}`", args.dir.display()))?;
    let mut command = crate::Cli::command();
    command.build();
    write_pages(&args.dir, &command, "wor")?;
    Ok(ExitCode::SUCCESS)
}

/// One page for `command` (named `name`, its path joined by `-`), then its subcommands'.
/// Depth is that of the command tree the binary defines, not of any input.
fn write_pages(dir: &std::path::Path, command: &clap::Command, name: &str) -> anyhow::Result<()> {
    let page = command.clone().name(name.to_owned());
    let mut text = Vec::new();
    clap_mangen::Man::new(page)
        .render(&mut text)
        .with_context(|| format!("cannot render the page of `{name}`"))?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, text).with_context(|| format!("cannot write `{}`", path.display()))?;
    println!("{}", path.display());
    for sub in command.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        write_pages(dir, sub, &format!("{name}-{}", sub.get_name()))?;
    }
    Ok(())
}
