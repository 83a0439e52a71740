"""Regenerate the bundled sample corpora from the hand-written facts below.

    python -m dataset.samples.generate_samples

writes, next to this file:
  domain_text.jsonl  raw text for phase 1 ({"text": ...}), one paragraph a line
  chat_qa.jsonl      chat Q&A for phase 2 ({"messages": [{role, content}, ...]})
  alpaca.jsonl       instruction data ({"instruction", "input", "output"})
  preference.jsonl   preference pairs (TRL's conversational form: "prompt", "chosen", "rejected"):
                     the fact chosen, a near miss rejected (another seat of the county's region,
                     another region, another river: the confusions a small model makes), two
                     near misses per fact

The domain is Romanian geography (the reference use case is Romanian), written for this
project. The texts follow recurring patterns on purpose: a tiny model trained for a few
minutes on a CPU must be able to learn something measurable from them, so the demo's eval
loss visibly drops. Output is deterministic (fixed seed); a test checks the committed files
match this script, so edit the facts here and rerun rather than editing the JSONL by hand.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20261122
HERE = Path(__file__).resolve().parent

# (county, seat, historical region, river at the seat or None, notable places)
COUNTIES = [
    ("Alba", "Alba Iulia", "Transilvania", "Mureș", ["Cetatea Alba Carolina", "drumul Transalpina"]),
    ("Arad", "Arad", "Crișana", "Mureș", ["Cetatea Aradului"]),
    ("Argeș", "Pitești", "Muntenia", "Argeș", ["Mănăstirea Curtea de Argeș", "Cetatea Poenari", "barajul Vidraru"]),
    ("Bacău", "Bacău", "Moldova", "Bistrița", ["stațiunea Slănic Moldova"]),
    ("Bihor", "Oradea", "Crișana", "Crișul Repede", ["Peștera Urșilor", "stațiunea Băile Felix"]),
    ("Bistrița-Năsăud", "Bistrița", "Transilvania", "Bistrița", ["Pasul Tihuța", "Munții Rodnei"]),
    ("Botoșani", "Botoșani", "Moldova", None, ["casa memorială Mihai Eminescu de la Ipotești"]),
    ("Brașov", "Brașov", "Transilvania", None, ["Biserica Neagră", "Castelul Bran", "stațiunea Poiana Brașov"]),
    ("Brăila", "Brăila", "Muntenia", "Dunărea", ["Parcul Natural Balta Mică a Brăilei"]),
    ("Buzău", "Buzău", "Muntenia", "Buzău", ["Vulcanii Noroioși"]),
    ("Caraș-Severin", "Reșița", "Banat", "Bârzava", ["Cheile Nerei", "stațiunea Băile Herculane", "Munții Semenic"]),
    ("Călărași", "Călărași", "Muntenia", "Borcea", ["malurile Dunării"]),
    ("Cluj", "Cluj-Napoca", "Transilvania", "Someșul Mic", ["Salina Turda", "Grădina Botanică din Cluj-Napoca"]),
    (
        "Constanța",
        "Constanța",
        "Dobrogea",
        None,
        ["Cazinoul din Constanța", "stațiunea Mamaia", "litoralul Mării Negre"],
    ),
    ("Covasna", "Sfântu Gheorghe", "Transilvania", "Olt", ["stațiunea Covasna"]),
    ("Dâmbovița", "Târgoviște", "Muntenia", "Ialomița", ["Curtea Domnească din Târgoviște", "Turnul Chindiei"]),
    ("Dolj", "Craiova", "Oltenia", "Jiu", ["Muzeul de Artă din Craiova"]),
    ("Galați", "Galați", "Moldova", "Dunărea", ["faleza Dunării"]),
    ("Giurgiu", "Giurgiu", "Muntenia", "Dunărea", ["Podul Prieteniei peste Dunăre"]),
    (
        "Gorj",
        "Târgu Jiu",
        "Oltenia",
        "Jiu",
        ["ansamblul Calea Eroilor al lui Constantin Brâncuși", "Coloana fără Sfârșit"],
    ),
    ("Harghita", "Miercurea Ciuc", "Transilvania", "Olt", ["Lacul Sfânta Ana", "Lacul Roșu"]),
    ("Hunedoara", "Deva", "Transilvania", "Mureș", ["Castelul Corvinilor", "Sarmizegetusa Regia"]),
    ("Ialomița", "Slobozia", "Muntenia", "Ialomița", ["stațiunea Amara"]),
    ("Iași", "Iași", "Moldova", "Bahlui", ["Palatul Culturii din Iași", "Universitatea Alexandru Ioan Cuza"]),
    ("Ilfov", "Buftea", "Muntenia", None, ["Mănăstirea Snagov", "Lacul Snagov"]),
    (
        "Maramureș",
        "Baia Mare",
        "Maramureș",
        "Săsar",
        ["bisericile de lemn din Maramureș", "Cimitirul Vesel din Săpânța"],
    ),
    ("Mehedinți", "Drobeta-Turnu Severin", "Oltenia", "Dunărea", ["Porțile de Fier", "Cazanele Dunării"]),
    ("Mureș", "Târgu Mureș", "Transilvania", "Mureș", ["cetatea Sighișoara", "Palatul Culturii din Târgu Mureș"]),
    ("Neamț", "Piatra Neamț", "Moldova", "Bistrița", ["Cetatea Neamț", "Lacul Bicaz", "Muntele Ceahlău"]),
    ("Olt", "Slatina", "Oltenia", "Olt", ["valea Oltului"]),
    ("Prahova", "Ploiești", "Muntenia", None, ["Castelul Peleș", "stațiunea Sinaia", "Munții Bucegi"]),
    ("Satu Mare", "Satu Mare", "Crișana", "Someș", ["centrul vechi din Satu Mare"]),
    ("Sălaj", "Zalău", "Transilvania", None, ["castrul roman Porolissum"]),
    ("Sibiu", "Sibiu", "Transilvania", "Cibin", ["Muzeul Brukenthal", "Podul Minciunilor", "lacul Bâlea"]),
    (
        "Suceava",
        "Suceava",
        "Bucovina",
        "Suceava",
        ["Mănăstirea Voroneț", "Mănăstirea Sucevița", "Cetatea de Scaun a Sucevei"],
    ),
    ("Teleorman", "Alexandria", "Muntenia", "Vedea", ["câmpia Teleormanului"]),
    ("Timiș", "Timișoara", "Banat", "Bega", ["Piața Victoriei din Timișoara", "canalul Bega"]),
    ("Tulcea", "Tulcea", "Dobrogea", "Dunărea", ["Delta Dunării"]),
    ("Vaslui", "Vaslui", "Moldova", None, ["locul bătăliei de la Podul Înalt"]),
    ("Vâlcea", "Râmnicu Vâlcea", "Oltenia", "Olt", ["Mănăstirea Horezu", "stațiunea Călimănești"]),
    ("Vrancea", "Focșani", "Moldova", "Milcov", ["podgoriile de la Panciu", "Mausoleul de la Mărășești"]),
]

REGIONS = {
    "Transilvania": "Transilvania ocupă centrul țării, în interiorul arcului Carpaților. Are orașe vechi cu cetăți, "
    "biserici fortificate și o istorie în care au trăit împreună români, maghiari și sași.",
    "Moldova": "Moldova se întinde în estul țării, între Carpații Orientali și râul Prut. Este o regiune de dealuri "
    "și podișuri, cu mănăstiri vechi și cu orașe universitare.",
    "Muntenia": "Muntenia se află în sudul țării, între Carpați și Dunăre. Cuprinde Câmpia Română, cea mai întinsă "
    "câmpie a țării, și capitala, București.",
    "Oltenia": "Oltenia se află în sud-vestul țării, la vest de râul Olt. Este cunoscută pentru ceramica de la "
    "Horezu, pentru podgorii și pentru orașul Craiova.",
    "Banat": "Banatul se află în vestul țării. Timișoara este cel mai mare oraș al regiunii, iar munții din sud "
    "adăpostesc chei adânci și stațiuni balneare vechi.",
    "Crișana": "Crișana se află în vestul țării, de-a lungul râurilor Crișuri. Oradea și Arad sunt orașele ei cele "
    "mai mari, cu clădiri în stil Secession.",
    "Dobrogea": "Dobrogea se află între Dunăre și Marea Neagră. Aici se găsesc litoralul românesc, portul "
    "Constanța și Delta Dunării.",
    "Maramureș": "Maramureșul se află în nordul țării. Este vestit pentru bisericile de lemn, porțile sculptate și "
    "tradițiile păstrate în sate.",
    "Bucovina": "Bucovina se află în nord-estul țării. Mănăstirile ei cu picturi exterioare sunt cunoscute în "
    "toată lumea.",
}

RIVERS = [
    ("Dunărea", "este cel mai lung râu care trece prin România și se varsă în Marea Neagră printr-o deltă"),
    ("Mureș", "izvorăște din Carpații Orientali și curge spre vest, prin Transilvania și Crișana, până în Ungaria"),
    ("Olt", "izvorăște din Carpații Orientali, traversează Carpații Meridionali și se varsă în Dunăre"),
    ("Siret", "curge prin Moldova, de la nord la sud, și se varsă în Dunăre lângă Galați"),
    ("Prut", "formează o parte din granița de est a țării și se varsă în Dunăre"),
    ("Jiu", "traversează Oltenia de la munte până la Dunăre"),
    ("Argeș", "izvorăște din Munții Făgăraș și se varsă în Dunăre"),
    ("Someș", "curge prin nordul Transilvaniei și trece prin orașul Satu Mare"),
    ("Ialomița", "izvorăște din Munții Bucegi și străbate Câmpia Română"),
    ("Bistrița", "curge prin Moldova și alimentează Lacul Bicaz"),
]

MOUNTAINS = [
    ("Munții Făgăraș", "au cele mai înalte vârfuri din țară, Moldoveanu, de 2544 de metri, și Negoiu"),
    ("Munții Bucegi", "se află deasupra Văii Prahovei și sunt cunoscuți pentru Babele și Sfinxul"),
    ("Munții Retezat", "adăpostesc primul parc național al țării și zeci de lacuri glaciare"),
    ("Munții Apuseni", "au peșteri, chei și sate risipite pe dealuri înalte"),
    ("Munții Rodnei", "se află în nordul țării și au vârful Pietrosul Rodnei"),
    ("Muntele Ceahlău", "se ridică deasupra Lacului Bicaz și este numit uneori Olimpul românesc"),
    ("Munții Semenic", "se află în Banat și au păduri întinse de fag"),
    ("Munții Călimani", "sunt cel mai mare masiv vulcanic din țară"),
]

SYSTEM_PROMPTS = [
    "Ești un asistent care răspunde scurt și corect, în limba română, la întrebări de geografie.",
    "Ești un ghid turistic prietenos. Răspunde în limba română, în una sau două propoziții.",
    "Răspunde concis, în limba română.",
]


def county_paragraphs(county: str, seat: str, region: str, river: str | None, places: list[str]) -> list[str]:
    """Paragraphs about one county, built from its facts."""
    paragraphs = [
        f"Județul {county} se află în {region}. Reședința sa este municipiul {seat}, cel mai important centru "
        f"administrativ al județului.",
        f"Administrația județului {county} funcționează la {seat}. Consiliul Județean și Prefectura au sediul în "
        f"acest municipiu, iar de aici pornesc drumuri spre toate localitățile județului.",
        f"Județul {county} are drept reședință orașul {seat}. La orele de geografie, elevii învață și regiunea "
        f"istorică din care face parte județul: {region}.",
        f"Printre locurile cunoscute din județul {county} se numără {places[0]}. Vizitatorii vin aici în toate "
        f"anotimpurile, iar mulți dintre ei opresc și la {seat}.",
    ]
    if river:
        paragraphs.append(
            f"Municipiul {seat} este așezat pe râul {river}. Râul a influențat dezvoltarea orașului, a comerțului "
            f"și a agriculturii din împrejurimi."
        )
    if len(places) > 1:
        others = ", ".join(places[1:])
        paragraphs.append(
            f"Cine ajunge în județul {county} poate vizita, pe lângă {places[0]}, și {others}. Toate se află în "
            f"{region}, la o distanță mică de {seat}."
        )
    return paragraphs


def domain_text(rng: random.Random) -> list[dict]:
    paragraphs = []
    for county in COUNTIES:
        paragraphs += county_paragraphs(*county)
    for region, text in REGIONS.items():
        counties = [c for c, _, r, _, _ in COUNTIES if r == region]
        paragraphs.append(text)
        paragraphs.append(f"În {region} se află județele {', '.join(counties)}.")
    for river, fact in RIVERS:
        paragraphs.append(f"Râul {river} {fact}.")
    for mountains, fact in MOUNTAINS:
        paragraphs.append(f"{mountains} {fact}.")
    rng.shuffle(paragraphs)
    return [{"text": p} for p in paragraphs]


def county_qa(county: str, seat: str, region: str, river: str | None, places: list[str]) -> list[tuple[str, str]]:
    """(question, answer) pairs about one county."""
    pairs = [
        (f"Care este reședința județului {county}?", f"Reședința județului {county} este municipiul {seat}."),
        (f"În ce regiune istorică se află județul {county}?", f"Județul {county} se află în {region}."),
        (f"Ce pot vizita în județul {county}?", f"În județul {county} merită să vizitezi {' și '.join(places[:2])}."),
    ]
    if river:
        pairs.append((f"Pe ce râu este așezat orașul {seat}?", f"Orașul {seat} este așezat pe râul {river}."))
    return pairs


def chat_qa(rng: random.Random) -> list[dict]:
    conversations = []
    for county in COUNTIES:
        pairs = county_qa(*county)
        # One single-turn conversation per fact...
        for question, answer in pairs:
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            conversations.append({"messages": messages})
        # ...and one multi-turn conversation that chains two or three of them.
        chosen = rng.sample(pairs, k=min(len(pairs), rng.choice([2, 3])))
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
        for question, answer in chosen:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        conversations.append({"messages": messages})
    for river, fact in RIVERS:
        conversations.append(
            {"messages": [{"role": "user", "content": f"Ce știi despre râul {river}?"},
                          {"role": "assistant", "content": f"Râul {river} {fact}."}]}
        )
    for mountains, fact in MOUNTAINS:
        conversations.append(
            {"messages": [{"role": "user", "content": f"Spune-mi ceva despre {mountains}."},
                          {"role": "assistant", "content": f"{mountains} {fact}."}]}
        )
    rng.shuffle(conversations)
    return conversations


def alpaca(rng: random.Random) -> list[dict]:
    records = []
    for county, seat, region, river, places in COUNTIES:
        records.append({"instruction": "Scrie reședința județului de mai jos.", "input": county, "output": seat})
        records.append({"instruction": "Numește regiunea istorică în care se află județul dat.", "input": county,
                        "output": region})
        records.append({"instruction": f"Descrie într-o propoziție județul {county}.", "input": "",
                        "output": f"Județul {county} se află în {region} și are reședința la {seat}."})
    rng.shuffle(records)
    return records


def preference(rng: random.Random) -> list[dict]:
    """Two pairs per fact of county_qa but the places: the fact chosen, each a different near miss
    rejected (as preference data often has several rejected answers to one prompt)."""
    regions = sorted({region for _, _, region, _, _ in COUNTIES})
    rivers = sorted({river for _, _, _, river, _ in COUNTIES if river})
    seats = sorted({seat for _, seat, _, _, _ in COUNTIES})
    records = []
    for county, seat, region, river, places in COUNTIES:
        neighbours = sorted({s for _, s, r, _, _ in COUNTIES if r == region and s != seat})
        wrong_seats = (neighbours + rng.sample([s for s in seats if s != seat and s not in neighbours], 2))[:2]
        misses = [[f"Reședința județului {county} este municipiul {s}." for s in wrong_seats],
                  [f"Județul {county} se află în {r}." for r in rng.sample([r for r in regions if r != region], 2)]]
        if river:
            misses.append([f"Orașul {seat} este așezat pe râul {r}."
                           for r in rng.sample([r for r in rivers if r != river], 2)])
        facts = [(q, a) for q, a in county_qa(county, seat, region, river, places) if not q.startswith("Ce pot")]
        for (question, answer), wrong in zip(facts, misses, strict=True):
            for miss in wrong:
                prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
                records.append({"prompt": prompt + [{"role": "user", "content": question}],
                                "chosen": [{"role": "assistant", "content": answer}],
                                "rejected": [{"role": "assistant", "content": miss}]})
    rng.shuffle(records)
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def render_all() -> dict[str, list[dict]]:
    """File name -> records, deterministically."""
    return {
        "domain_text.jsonl": domain_text(random.Random(SEED)),
        "chat_qa.jsonl": chat_qa(random.Random(SEED + 1)),
        "alpaca.jsonl": alpaca(random.Random(SEED + 2)),
        "preference.jsonl": preference(random.Random(SEED + 3)),
    }


def main() -> None:
    for name, records in render_all().items():
        write_jsonl(HERE / name, records)
        print(f"wrote {len(records)} records to {HERE / name}")


if __name__ == "__main__":
    main()
