"""``ledger``: a small-business bookkeeping app (tool_use).

State is a SQLite database: ``accounts``, ``transactions`` and ``invoices``.
Amounts are dollars on the API and integer cents in the database. A new
transaction's date defaults to the instance's today and its ``reference`` is
drawn from the instance's random source, so a reset's ``seed`` and
``timestamp`` decide both (:mod:`fleetroll.emulator.instances`). Tools that
get bad arguments (unknown account, non-positive amount, bad date, paying a
void invoice...) answer with an MCP tool error, like a real API would.
"""

from __future__ import annotations

import random
import re
import sqlite3
from datetime import date
from typing import Any, ClassVar, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from PIL import Image

from fleetroll.emulator.computer import Screen, blank, font
from fleetroll.emulator.envs.base import SampleEnv, ToolGate, create_schema

__all__ = ["LedgerEnv"]

AccountKind = Literal["asset", "liability", "income", "expense", "equity"]
InvoiceStatus = Literal["open", "paid", "void"]

_SCHEMA = """
CREATE TABLE accounts (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    balance_cents INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE transactions (
    id INTEGER PRIMARY KEY,
    date TEXT NOT NULL,
    description TEXT NOT NULL,
    from_account TEXT NOT NULL,
    to_account TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    reference TEXT
);
CREATE TABLE invoices (
    id INTEGER PRIMARY KEY,
    customer TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    due_date TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'open',
    paid_to TEXT
);
"""

_ACCOUNTS: dict[str, list[tuple[str, str, int]]] = {
    "seed": [
        ("Checking", "asset", 1_250_000),
        ("Savings", "asset", 4_000_000),
        ("Petty Cash", "asset", 20_000),
        ("Credit Card", "liability", 85_000),
        ("Sales", "income", 0),
        ("Consulting Income", "income", 0),
        ("Rent", "expense", 0),
        ("Office Supplies", "expense", 0),
        ("Software", "expense", 0),
        ("Travel", "expense", 0),
        ("Owner Equity", "equity", 5_185_000),
    ],
    "busy": [
        ("Checking", "asset", 310_000),
        ("Savings", "asset", 900_000),
        ("Credit Card", "liability", 240_000),
        ("Sales", "income", 0),
        ("Rent", "expense", 0),
        ("Utilities", "expense", 0),
        ("Payroll", "expense", 0),
        ("Owner Equity", "equity", 970_000),
    ],
}

_TRANSACTIONS: dict[str, list[tuple[str, str, str, str, int]]] = {
    "seed": [
        ("2026-10-01", "October rent", "Checking", "Rent", 180_000),
        ("2026-10-03", "Printer paper", "Petty Cash", "Office Supplies", 4_500),
        ("2026-10-05", "Code editor licence", "Credit Card", "Software", 12_000),
        ("2026-10-09", "Client workshop", "Consulting Income", "Checking", 250_000),
        ("2026-10-14", "Train to Lyon", "Credit Card", "Travel", 9_800),
    ],
    "busy": [
        ("2026-09-01", "September rent", "Checking", "Rent", 150_000),
        ("2026-09-02", "Electricity", "Checking", "Utilities", 21_000),
        ("2026-09-15", "Payroll run 17", "Checking", "Payroll", 400_000),
        ("2026-09-20", "Storefront sales", "Sales", "Checking", 380_000),
        ("2026-09-30", "Payroll run 18", "Checking", "Payroll", 400_000),
        ("2026-10-01", "October rent", "Checking", "Rent", 150_000),
    ],
}

_INVOICES: dict[str, list[tuple[str, int, str, str]]] = {
    "seed": [
        ("Acme Corp", 320_000, "2026-11-30", "open"),
        ("Globex", 145_000, "2026-11-15", "open"),
        ("Initech", 98_000, "2026-10-31", "paid"),
        ("Umbrella", 60_000, "2026-12-10", "open"),
    ],
    "busy": [
        ("Stark Industries", 1_200_000, "2026-10-15", "open"),
        ("Wayne Enterprises", 450_000, "2026-10-20", "open"),
        ("Wonka", 75_000, "2026-09-30", "void"),
    ],
}

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _cents(amount: float, what: str = "amount") -> int:
    if not isinstance(amount, int | float) or amount != amount:  # NaN
        raise ToolError(f"{what} must be a number")
    cents = round(amount * 100)
    if cents <= 0:
        raise ToolError(f"{what} must be positive, got {amount}")
    return cents


def _date(value: str | None, today: date | None = None) -> str:
    if value is None:
        return (today or date.today()).isoformat()
    if not _DATE.match(value):
        raise ToolError(f"date must be YYYY-MM-DD, got {value!r}")
    try:
        return date.fromisoformat(value).isoformat()
    except ValueError:
        raise ToolError(f"{value!r} is not a real date") from None


def _reference(rng: random.Random) -> str:
    """A transaction's bank reference, from the instance's random source."""
    return f"TX-{rng.getrandbits(40):010X}"


def _dollars(cents: int) -> float:
    return round(cents / 100, 2)


def _account(conn: sqlite3.Connection, name: str) -> tuple[int, str, str, int]:
    row = conn.execute(
        "SELECT id, name, kind, balance_cents FROM accounts WHERE name = ? COLLATE NOCASE",
        (name,),
    ).fetchone()
    if row is None:
        known = ", ".join(r[0] for r in conn.execute("SELECT name FROM accounts ORDER BY id"))
        raise ToolError(f"unknown account {name!r}; accounts are: {known}")
    return row  # type: ignore[no-any-return]


def _apply(conn: sqlite3.Connection, from_name: str, to_name: str, cents: int) -> None:
    """Move money: ``from`` loses (assets) or gains (liability, income, equity) it."""
    for name, sign in ((from_name, -1), (to_name, +1)):
        _, _, kind, _ = _account(conn, name)
        # Asset and expense balances grow with debits; the rest grow with credits.
        delta = sign * cents if kind in ("asset", "expense") else -sign * cents
        conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + ? WHERE name = ? COLLATE NOCASE",
            (delta, name),
        )


def _invoice(conn: sqlite3.Connection, invoice_id: int) -> tuple[int, str, int, str, str]:
    row = conn.execute(
        "SELECT id, customer, amount_cents, due_date, status FROM invoices WHERE id = ?",
        (invoice_id,),
    ).fetchone()
    if row is None:
        raise ToolError(f"no invoice with id {invoice_id}")
    return row  # type: ignore[no-any-return]


def _invoice_json(row: tuple[Any, ...]) -> dict[str, Any]:
    return {
        "id": row[0],
        "customer": row[1],
        "amount": _dollars(row[2]),
        "due_date": row[3],
        "status": row[4],
    }


class LedgerScreen(Screen):
    """A read-only view of the ledger: accounts and open invoices."""

    def render(self, conn: sqlite3.Connection) -> Image.Image:
        image, draw = blank(self, "#ffffff")
        draw.rectangle((0, 0, self.width, 48), fill="#1f3a5f")
        draw.text((16, 12), "Ledger", fill="#ffffff", font=font(22))
        y = 70
        draw.text((16, y), "Accounts", fill="#1f3a5f", font=font(18))
        y += 30
        for name, kind, cents in conn.execute(
            "SELECT name, kind, balance_cents FROM accounts ORDER BY id"
        ):
            draw.text((24, y), f"{name} ({kind})", fill="#222222", font=font(15))
            draw.text((420, y), f"{cents / 100:,.2f}", fill="#222222", font=font(15))
            y += 22
        y += 16
        draw.text((16, y), "Open invoices", fill="#1f3a5f", font=font(18))
        y += 30
        for inv_id, customer, cents, due in conn.execute(
            "SELECT id, customer, amount_cents, due_date FROM invoices WHERE status = 'open'"
        ):
            draw.text((24, y), f"#{inv_id} {customer} due {due}", fill="#222222", font=font(15))
            draw.text((420, y), f"{cents / 100:,.2f}", fill="#222222", font=font(15))
            y += 22
        return image


class LedgerEnv(SampleEnv):
    key: ClassVar[str] = "ledger"
    name: ClassVar[str] = "Ledger"
    description: ClassVar[str] = (
        "A small-business ledger: accounts, transactions and invoices. Amounts are in dollars."
    )
    modality = "tool_use"
    data_keys: ClassVar[tuple[str, ...]] = ("seed", "busy")

    def seed(self, conn: sqlite3.Connection, data_key: str) -> None:
        create_schema(conn, _SCHEMA)
        conn.executemany(
            "INSERT INTO accounts (name, kind, balance_cents) VALUES (?, ?, ?)", _ACCOUNTS[data_key]
        )
        conn.executemany(
            "INSERT INTO transactions (date, description, from_account, to_account, amount_cents)"
            " VALUES (?, ?, ?, ?, ?)",
            _TRANSACTIONS[data_key],
        )
        conn.executemany(
            "INSERT INTO invoices (customer, amount_cents, due_date, status) VALUES (?, ?, ?, ?)",
            _INVOICES[data_key],
        )

    def screen(self) -> Screen:
        return LedgerScreen()

    def register_tools(self, server: MCPServer, gate: ToolGate) -> None:
        self._register_account_tools(server, gate)
        self._register_transaction_tools(server, gate)
        self._register_invoice_tools(server, gate)

    def _register_account_tools(self, server: MCPServer, gate: ToolGate) -> None:
        """The chart of accounts: list, one balance, a new account."""

        @server.tool(description="List every account with its kind and balance in dollars.")
        async def list_accounts(ctx: Context) -> list[dict[str, Any]]:
            conn = (await gate.enter(ctx)).conn
            return [
                {"name": n, "kind": k, "balance": _dollars(c)}
                for n, k, c in conn.execute(
                    "SELECT name, kind, balance_cents FROM accounts ORDER BY id"
                )
            ]

        @server.tool(description="The balance of one account, in dollars.")
        async def get_balance(account: str, ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            _, name, kind, cents = _account(conn, account)
            return {"account": name, "kind": kind, "balance": _dollars(cents)}

        @server.tool(description="Open a new account with a zero balance.")
        async def add_account(name: str, kind: AccountKind, ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            name = name.strip()
            if not name:
                raise ToolError("account name must not be empty")
            try:
                conn.execute("INSERT INTO accounts (name, kind) VALUES (?, ?)", (name, kind))
            except sqlite3.IntegrityError:
                raise ToolError(f"an account named {name!r} already exists") from None
            return {"account": name, "kind": kind, "balance": 0.0}

    def _register_transaction_tools(self, server: MCPServer, gate: ToolGate) -> None:
        """Money moving between accounts: record one, search them."""

        @server.tool(
            description=(
                "Record money moving from one account to another (e.g. from Checking to Rent "
                "to pay rent). amount in dollars, date as YYYY-MM-DD (default today)."
            )
        )
        async def record_transaction(
            from_account: str,
            to_account: str,
            amount: float,
            description: str,
            ctx: Context,
            date: str | None = None,
        ) -> dict[str, Any]:
            inst = await gate.enter(ctx)
            conn = inst.conn
            cents = _cents(amount)
            day = _date(date, inst.now().date())
            src = _account(conn, from_account)
            dst = _account(conn, to_account)
            if src[0] == dst[0]:
                raise ToolError("from_account and to_account must differ")
            if src[2] == "asset" and src[3] < cents:
                raise ToolError(
                    f"insufficient funds in {src[1]}: balance {_dollars(src[3])}, "
                    f"needed {_dollars(cents)}"
                )
            _apply(conn, src[1], dst[1], cents)
            reference = _reference(inst.rng)
            cur = conn.execute(
                "INSERT INTO transactions (date, description, from_account, to_account,"
                " amount_cents, reference) VALUES (?, ?, ?, ?, ?, ?)",
                (day, description, src[1], dst[1], cents, reference),
            )
            return {
                "transaction_id": cur.lastrowid,
                "date": day,
                "from_account": src[1],
                "to_account": dst[1],
                "amount": _dollars(cents),
                "reference": reference,
            }

        @server.tool(
            description=(
                "Search transactions by text in their description and/or by account; newest first."
            )
        )
        async def search_transactions(
            ctx: Context, query: str = "", account: str | None = None, limit: int = 20
        ) -> list[dict[str, Any]]:
            conn = (await gate.enter(ctx)).conn
            if not 1 <= limit <= 200:
                raise ToolError("limit must be between 1 and 200")
            sql = (
                "SELECT id, date, description, from_account, to_account, amount_cents "
                "FROM transactions WHERE description LIKE ?"
            )
            params: list[Any] = [f"%{query}%"]
            if account is not None:
                name = _account(conn, account)[1]
                sql += " AND (from_account = ? OR to_account = ?)"
                params += [name, name]
            sql += " ORDER BY date DESC, id DESC LIMIT ?"
            params.append(limit)
            return [
                {
                    "id": r[0],
                    "date": r[1],
                    "description": r[2],
                    "from_account": r[3],
                    "to_account": r[4],
                    "amount": _dollars(r[5]),
                }
                for r in conn.execute(sql, params)
            ]

    def _register_invoice_tools(self, server: MCPServer, gate: ToolGate) -> None:
        """Invoices: create, list, mark paid (a deposit booked as Sales), void."""

        @server.tool(description="Create an open invoice for a customer (due_date YYYY-MM-DD).")
        async def create_invoice(
            customer: str, amount: float, due_date: str, ctx: Context
        ) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            if not customer.strip():
                raise ToolError("customer must not be empty")
            cents = _cents(amount)
            due = _date(due_date)
            cur = conn.execute(
                "INSERT INTO invoices (customer, amount_cents, due_date) VALUES (?, ?, ?)",
                (customer.strip(), cents, due),
            )
            assert cur.lastrowid is not None
            return _invoice_json(_invoice(conn, cur.lastrowid))

        @server.tool(description="List invoices, optionally only those with one status.")
        async def list_invoices(
            ctx: Context, status: InvoiceStatus | None = None
        ) -> list[dict[str, Any]]:
            conn = (await gate.enter(ctx)).conn
            sql = "SELECT id, customer, amount_cents, due_date, status FROM invoices"
            rows = (
                conn.execute(sql + " WHERE status = ? ORDER BY id", (status,))
                if status
                else conn.execute(sql + " ORDER BY id")
            )
            return [_invoice_json(r) for r in rows]

        @server.tool(
            description=(
                "Mark an open invoice as paid; its amount is deposited into deposit_account "
                "and booked as Sales income."
            )
        )
        async def mark_invoice_paid(
            invoice_id: int, deposit_account: str, ctx: Context
        ) -> dict[str, Any]:
            inst = await gate.enter(ctx)
            conn = inst.conn
            inv = _invoice(conn, invoice_id)
            if inv[4] != "open":
                raise ToolError(f"invoice {invoice_id} is {inv[4]}, not open")
            dst = _account(conn, deposit_account)
            if dst[2] != "asset":
                raise ToolError(f"deposit_account must be an asset account, {dst[1]} is {dst[2]}")
            _apply(conn, "Sales", dst[1], inv[2])
            conn.execute(
                "INSERT INTO transactions (date, description, from_account, to_account,"
                " amount_cents, reference) VALUES (?, ?, 'Sales', ?, ?, ?)",
                (
                    inst.now().date().isoformat(),
                    f"Payment of invoice #{inv[0]} ({inv[1]})",
                    dst[1],
                    inv[2],
                    _reference(inst.rng),
                ),
            )
            conn.execute(
                "UPDATE invoices SET status = 'paid', paid_to = ? WHERE id = ?",
                (dst[1], invoice_id),
            )
            return _invoice_json(_invoice(conn, invoice_id))

        @server.tool(description="Void an open invoice.")
        async def void_invoice(invoice_id: int, ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            inv = _invoice(conn, invoice_id)
            if inv[4] != "open":
                raise ToolError(
                    f"invoice {invoice_id} is {inv[4]}, only open invoices can be voided"
                )
            conn.execute("UPDATE invoices SET status = 'void' WHERE id = ?", (invoice_id,))
            return _invoice_json(_invoice(conn, invoice_id))
