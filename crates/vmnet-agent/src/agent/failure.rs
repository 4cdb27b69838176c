//! A failed apply: the previous good config back in the kernel and the stored row as it was.

use super::*;

impl Agent {
    /// After a failed apply of `cfg`: re-applies the previous good config (or removes the VM
    /// when it had none) and puts the stored row back as it was `before`, with the error
    /// recorded (a VM not stored before is deleted again when `written`, the new row having
    /// been saved during the apply). One write. Returns the error to answer.
    pub(super) async fn put_failed(
        &self,
        cfg: &VmConfig,
        before: Option<VmRow>,
        prev_good: Option<&VmConfig>,
        err: Error,
        written: bool,
    ) -> Error {
        let restored = self.restore_after_failure(cfg, prev_good).await;
        let message = format!("vm {}: apply failed: {}{restored}", cfg.id, err.message);
        let op = if before.is_some() { "change" } else { "create" };
        tracing::warn!(vm = %cfg.id, op, code = %err.code, error = %message, "vm apply failed");
        let put_back: Result<(), Error> = match before {
            Some(b) => {
                let row = VmRow {
                    last_error: Some(message.clone()),
                    updated_at: now_ms(),
                    ..b
                };
                async { store_tx!(self.db, tx => vm_store::save(tx, &row).await) }.await
            }
            None if written => {
                async { store_tx!(self.db, tx => vm_store::delete(tx, &cfg.id).await) }
                    .await
                    .map(|_| ())
            }
            None => Ok(()),
        };
        if let Err(e) = put_back {
            tracing::warn!(vm = %cfg.id, op = "restore", "putting the stored VM back after the failed apply failed: {e}");
        }
        let e = Error::new(err.code, message);
        self.emit_failed(cfg, &e);
        e
    }

    /// Publishes `vm_failed` for a PUT of `cfg` that failed with `e`.
    pub(super) fn emit_failed(&self, cfg: &VmConfig, e: &Error) {
        let body = crate::events::EventBody::VmFailed {
            code: e.code,
            message: e.message.clone(),
            trigger: crate::events::Trigger::Api,
        };
        self.emit_vm(&cfg.id, cfg.user_id, body);
    }

    /// After a failed apply of `cfg`: re-apply the previous good config, or remove the VM when
    /// there was none. Returns a sentence for the error message.
    pub(super) async fn restore_after_failure(
        &self,
        cfg: &VmConfig,
        prev_good: Option<&VmConfig>,
    ) -> String {
        match prev_good {
            Some(prev) => {
                if prev.user_id != cfg.user_id {
                    let _ = self.driver.remove(cfg.user_id).await;
                }
                match self.plan(prev) {
                    Ok(p) => match self.driver.apply(&p).await {
                        Ok(_) => "; the previous config stays applied".to_owned(),
                        Err(e) => format!("; re-applying the previous config also failed: {e}"),
                    },
                    Err(e) => format!("; the previous config does not plan: {}", e.message),
                }
            }
            None => match self.driver.remove(cfg.user_id).await {
                Ok(_) => "; nothing of the VM was kept".to_owned(),
                Err(e) => format!("; removing the partial VM also failed: {e}"),
            },
        }
    }
}
