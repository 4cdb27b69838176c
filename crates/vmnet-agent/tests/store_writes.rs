//! How often a VM change writes the store, and what a crash between the apply and that write
//! leaves: in-process over a temporary SQLite file and a fresh PostgreSQL database (triggers
//! log every row write of `vm_configs`) and the fake driver.
//!
//! A PUT checks (reading) that the user id and mesh address are free, then applies and stores
//! the config as desired and applied in one write, made while the kernel applies it (a failed
//! apply puts the row back: a second write on that path only). An agent killed after its apply
//! and before that write committed left the store as it was, and a full pass converges the
//! kernel back to it.

mod common;

use axum::http::Method;
use common::Harness;
use serde_json::{Value, json};
use vmnet_ipam::Db;

fn vm(id: &str, uid: u32) -> Value {
    json!({"id": id, "user_id": uid, "tenant": 1, "mesh_ipv6": format!("fdaa:1::{uid:x}"),
           "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}})
}

/// Row writes of `vm_configs`, logged by triggers into `write_log` on either store.
enum WriteLog {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

/// Logs every insert, update and delete of a `vm_configs` row in `write_log`.
async fn log_writes(db: &Db) -> WriteLog {
    match db {
        Db::Sqlite(s) => {
            sqlx::raw_sql(
                "CREATE TABLE write_log (op TEXT NOT NULL);
                 CREATE TRIGGER log_insert AFTER INSERT ON vm_configs
                   BEGIN INSERT INTO write_log VALUES ('insert'); END;
                 CREATE TRIGGER log_update AFTER UPDATE ON vm_configs
                   BEGIN INSERT INTO write_log VALUES ('update'); END;
                 CREATE TRIGGER log_delete AFTER DELETE ON vm_configs
                   BEGIN INSERT INTO write_log VALUES ('delete'); END;",
            )
            .execute(&s.pool)
            .await
            .unwrap();
            WriteLog::Sqlite(s.pool.clone())
        }
        Db::Postgres(p) => {
            sqlx::raw_sql(
                "CREATE TABLE write_log (n BIGSERIAL PRIMARY KEY, op TEXT NOT NULL);
                 CREATE FUNCTION log_write() RETURNS trigger LANGUAGE plpgsql AS $$
                   BEGIN INSERT INTO write_log (op) VALUES (lower(TG_OP)); RETURN NULL; END $$;
                 CREATE TRIGGER log_writes AFTER INSERT OR UPDATE OR DELETE ON vm_configs
                   FOR EACH ROW EXECUTE FUNCTION log_write();",
            )
            .execute(&p.pool)
            .await
            .unwrap();
            WriteLog::Postgres(p.pool.clone())
        }
    }
}

/// The row writes logged since the last call (and clears the log).
async fn writes(log: &WriteLog) -> Vec<String> {
    let clear = "DELETE FROM write_log";
    let ops: Vec<(String,)> = match log {
        WriteLog::Sqlite(p) => {
            let ops = sqlx::query_as("SELECT op FROM write_log ORDER BY rowid")
                .fetch_all(p)
                .await
                .unwrap();
            sqlx::query(clear).execute(p).await.unwrap();
            ops
        }
        WriteLog::Postgres(p) => {
            let ops = sqlx::query_as("SELECT op FROM write_log ORDER BY n")
                .fetch_all(p)
                .await
                .unwrap();
            sqlx::query(clear).execute(p).await.unwrap();
            ops
        }
    };
    ops.into_iter().map(|(o,)| o).collect()
}

#[tokio::test]
async fn every_change_is_one_store_write_sqlite() {
    every_change_is_one_store_write(&Harness::new().await).await;
}

#[tokio::test]
async fn every_change_is_one_store_write_postgres() {
    every_change_is_one_store_write(&Harness::postgres().await).await;
}

async fn every_change_is_one_store_write(h: &Harness) {
    let pool = log_writes(h.agent.db()).await;

    // A new VM: one insert, already applied.
    let (st, v) = h.put_vm(&vm("vm-1", 1)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["state"], "applied");
    assert_eq!(writes(&pool).await, ["insert"]);

    // Re-putting it unchanged writes nothing.
    assert_eq!(h.put_vm(&vm("vm-1", 1)).await.0, 200);
    assert!(writes(&pool).await.is_empty());

    // A change: one write.
    let mut changed = vm("vm-1", 1);
    changed["network"]["routes"] = json!([{"destination": "::/0", "via": "host"}]);
    let (st, v) = h.put_vm(&changed).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["applied_routes"], changed["network"]["routes"]);
    assert_eq!(writes(&pool).await, ["update"]);

    // A failed change: the write made during the apply, then the row put back with the error
    // recorded; the good config kept.
    h.driver.fail_changes(1, true);
    assert_eq!(h.put_vm(&vm("vm-1", 1)).await.0, 503);
    assert_eq!(writes(&pool).await, ["update", "update"]);
    let (_, v) = h.call(Method::GET, "/v1/vms/vm-1", None).await;
    assert_eq!(v["config"], changed);
    assert_eq!(v["status"]["state"], "failed");

    // A failed new VM is not kept (its row, written during the apply, is deleted again); a
    // conflicting one writes nothing.
    h.driver.fail(2, true);
    assert_eq!(h.put_vm(&vm("vm-2", 2)).await.0, 503);
    assert_eq!(writes(&pool).await, ["insert", "delete"]);
    assert_eq!(h.call(Method::GET, "/v1/vms/vm-2", None).await.0, 404);
    assert_eq!(h.put_vm(&vm("vm-3", 1)).await.0, 409);
    assert!(writes(&pool).await.is_empty());

    // A delete: one write.
    assert_eq!(h.call(Method::DELETE, "/v1/vms/vm-1", None).await.0, 200);
    assert_eq!(writes(&pool).await, ["delete"]);
}

#[tokio::test]
async fn a_crash_between_apply_and_write_converges_to_the_store() {
    let h = Harness::new().await;
    let (st, _) = h.put_vm(&vm("vm-1", 1)).await;
    assert_eq!(st, 200);
    let good = h.driver.applied(1).unwrap();
    // As an agent killed after its apply and before its write leaves it: the kernel holds a
    // changed VM 1 and a new VM 7 that the store never heard of.
    let plan = |cfg: &Value| {
        vmnet_plan::ns::plan_vm(
            &vmnet_model::vm::parse_vm_config(cfg.to_string().as_bytes()).unwrap(),
            h.agent.settings(),
        )
        .unwrap()
    };
    let mut changed = vm("vm-1", 1);
    changed["network"]["routes"] = json!([]);
    {
        let mut k = h.driver.kernel();
        k.vms.insert(1, plan(&changed));
        k.vms.insert(7, plan(&vm("vm-7", 7)));
    }
    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.collected, [7], "the unstored VM is collected");
    assert_eq!(
        h.driver.applied(1).unwrap(),
        good,
        "the stored config is back"
    );
    assert_eq!(h.call(Method::GET, "/v1/vms/vm-7", None).await.0, 404);
}
